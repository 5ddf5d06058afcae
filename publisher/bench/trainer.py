"""The sync bench's trainer: a Llama-shaped fp32 model taking real AdamW steps, and how it
runs Python's garbage collector (``TrainerCollector``).

Invariant: every step moves the weights the way an RL step does (dense random gradients,
a small learning rate), so a fixed share of the bf16 served bits changes per step.
"""

from __future__ import annotations

import gc
import time

import torch

from weftboard.cuda.digest import root_digest, tensor_digest


def model_shapes(params: int) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-shaped tensors whose total is about ``params`` (at least one layer)."""
    d, vocab = 768, 32000
    if params < 20_000_000:  # small smoke sizes
        d, vocab = 128, 1024
    hidden = 4 * d
    per_layer = 4 * d * d + 3 * d * hidden + 2 * d
    fixed = 2 * vocab * d + d
    layers = max(1, round((params - fixed) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (d, d)),
            (p + "self_attn.k_proj.weight", (d, d)),
            (p + "self_attn.v_proj.weight", (d, d)),
            (p + "self_attn.o_proj.weight", (d, d)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (hidden, d)),
            (p + "mlp.up_proj.weight", (hidden, d)),
            (p + "mlp.down_proj.weight", (d, hidden)),
        ]
    shapes += [("model.norm.weight", (d,)), ("lm_head.weight", (vocab, d))]
    return shapes


class TrainerCollector:
    """How the bench's trainer runs Python's cyclic garbage collector.

    ``"manual"`` (the default) is what large trainers do (Megatron-LM's manual GC, TorchTitan's
    ``gc_freq``): automatic collection off after one full collection at start-up, and a young
    collection (``gc.collect(1)``) every ``every`` steps at a step boundary. With ``"auto"``
    Python collects whenever its allocation counters say so: a full collection of a trainer
    process (torch, numba and the in-process board leave ~440k tracked objects) stops every
    thread for 0.1-0.3 s, wherever it falls, also while the optimizer waits for the
    publisher's read; the bench then measures the collector as much as the publisher.
    The manual collections are timed (``seconds``) and reported.
    """

    MODES = ("manual", "auto")

    def __init__(self, mode: str = "manual", every: int = 10) -> None:
        if mode not in self.MODES:
            raise ValueError(f"trainer GC mode must be one of {self.MODES}, got {mode!r}")
        if every < 1:
            raise ValueError(f"collect every N steps needs N >= 1, got {every}")
        self.mode, self.every = mode, every
        self.seconds = 0.0
        self.collections = 0
        self._was_enabled: bool | None = None

    def describe(self) -> str:
        if self.mode == "auto":
            return "auto (Python's default thresholds)"
        return f"manual (automatic collection off, gc.collect(1) every {self.every} steps at a step boundary)"

    def start(self) -> None:
        if self.mode == "manual" and self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()

    def step_boundary(self, step: int) -> None:
        if self.mode == "manual" and self._was_enabled is not None and step % self.every == 0:
            t = time.perf_counter()
            gc.collect(1)
            self.seconds += time.perf_counter() - t
            self.collections += 1

    def stop(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None


class BenchTrainer:
    """fp32 master weights, fused AdamW at lr 3e-6, dense random gradients each step.

    The gradients stand in for a forward/backward pass, which a real trainer runs on its
    accelerators. Drawing 100M fresh normals per step would make this 2-core host measure
    its random number generator instead of the sync pipeline, so each step copies a window
    of a bank of N(0, 1) samples drawn once, at a fresh random offset: dense, unit scale,
    and unrelated from one step to the next, which is what Adam sees in an RL step.
    """

    def __init__(self, params: int, lr: float = 3e-6, seed: int = 0, collector: TrainerCollector | None = None) -> None:
        self.collector = collector or TrainerCollector("auto")
        g = torch.Generator().manual_seed(seed)
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, shape in model_shapes(params):
            if len(shape) == 1:
                t = 1.0 + 0.05 * torch.randn(shape, generator=g)
            else:
                t = 0.02 * torch.randn(shape, generator=g)
            self.params[name] = torch.nn.Parameter(t)
        for p in self.params.values():
            p.grad = torch.zeros_like(p)
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr, fused=True)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self._slack = 1 << 20
        self._bank = torch.randn(self.numel + self._slack, generator=self.gen)
        self.steps = 0

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def step(self) -> None:
        self.collector.step_boundary(self.steps)
        offset = int(torch.randint(0, self._slack, (1,), generator=self.gen))
        with torch.no_grad():
            for p in self.params.values():
                n = p.numel()
                p.grad.copy_(self._bank[offset : offset + n].view_as(p))
                offset += n
        self.opt.step()
        self.steps += 1

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.params.items()}

    def served_root(self) -> str:
        """Root digest of the bf16 served view, computed independently of the publisher."""
        entries = []
        for name, p in self.params.items():
            entries.append((name, "bfloat16", list(p.shape), tensor_digest(p.detach().to(torch.bfloat16))))
        return root_digest(entries)

    def served(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16) for k, v in self.params.items()}
