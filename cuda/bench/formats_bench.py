"""``weftboard bench formats``: patch density of each scale policy on the same AdamW steps.

Baseline and candidates run in one process on the same master and the same optimizer steps:
"recompute" (fresh scales every version) is the baseline; "fixed" and "pow2" are reported as
ratios against it. Density counts changed stored elements *including the scale tensors*,
over the quantized tensors (the bf16 norms/embeddings are the same under every policy and
would only dilute the comparison); the whole-view figure is printed too.

Two sources are measured, because they behave differently: the fp32 master itself (every
amax moves a little every step) and its bf16 export (an amax moves rarely, by a whole bf16
ulp, which is when recomputed scales rewrite a tensor).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from weftboard.cuda import formats

if TYPE_CHECKING:  # torch loads inside the command, so `weftboard --help` stays fast
    import torch

VARIANTS = (
    ("fp8_e4m3", "tensor"),
    ("fp8_e4m3", "block128"),
    ("fp8_e5m2", "tensor"),
    ("mxfp4", "tensor"),
    ("nvfp4", "tensor"),
)
POLICIES = ("recompute", "fixed", "pow2")


def _quantized_part(view: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in view.items() if t.dtype != torch.bfloat16}


def run(
    *,
    layers: int = 2,
    hidden: int = 256,
    intermediate: int = 768,
    vocab: int = 2048,
    steps: int = 3,
    lr: float = 3e-6,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One row per (source, format, policy): mean per-step density and scale elements moved."""

    t0 = time.perf_counter()
    master = formats.make_test_master(layers=layers, hidden=hidden, intermediate=intermediate, vocab=vocab, seed=seed)
    states = [master, *formats.adamw_steps(master, steps, lr=lr, seed=seed + 1)]
    params = sum(t.numel() for t in master.values())
    log(f"model: {params / 1e6:.2f}M params, {steps} AdamW steps at lr {lr:g} ({time.perf_counter() - t0:.1f}s)")
    sources = {
        "fp32 master": states,
        "bf16 export": [{n: t.to(torch.bfloat16) for n, t in s.items()} for s in states],
    }
    rows: list[dict[str, Any]] = []
    for source, versions in sources.items():
        for kind, granularity in VARIANTS:
            baseline = None
            for policy in POLICIES:
                projector = formats.Projector(formats.ServedFormatSpec(kind, granularity, policy))
                previous = projector.project(versions[0], anchor=True)
                quantized = [0, 0, 0]
                whole = [0, 0]
                for version in versions[1:]:
                    current = projector.project(version, anchor=False)
                    part = formats.transition_density(_quantized_part(previous), _quantized_part(current))
                    full = formats.transition_density(previous, current)
                    quantized = [a + b for a, b in zip(quantized, part, strict=True)]
                    whole = [whole[0] + full.changed, whole[1] + full.total]
                    previous = current
                density = quantized[0] / quantized[1]
                row = {
                    "source": source,
                    "format": kind if kind.startswith(("mx", "nv")) else f"{kind}/{granularity}",
                    "policy": policy,
                    "density": density,
                    "density_whole_view": whole[0] / whole[1],
                    "scale_elements_changed": quantized[2],
                    "changed": quantized[0],
                }
                if policy == "recompute":
                    baseline = density
                row["vs_recompute"] = density / baseline if baseline else float("nan")
                rows.append(row)
                log(
                    f"{source:12s} {row['format']:18s} {policy:9s} density {density:8.4%} "
                    f"(whole view {row['density_whole_view']:7.4%}), scale elements changed "
                    f"{quantized[2]:6d}, x{row['vs_recompute']:.3f} of recompute"
                )
    log(f"total {time.perf_counter() - t0:.1f}s")
    return rows

