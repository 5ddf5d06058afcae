"""Served-view projections: master weights -> the exact stored tensors a serving engine loads.

The publisher diffs *stored* bytes, so this module decides, for every master tensor, which
stored tensors it becomes, their names, dtypes, shapes and bytes.

Stored names (what engines load):

==============  ===========================================  ===============================
kind            ``<name>`` (the master's name)               companions, in this order
==============  ===========================================  ===============================
bf16 / fp16     bfloat16 / float16, same shape               -
fp8, tensor     float8_e4m3fn / float8_e5m2, same shape      ``<name>_scale`` float32 [1]
fp8, block128   float8, same shape                           ``<name>_scale_inv`` float32
                                                             [ceil(rows/128), ceil(cols/128)]
mxfp4           uint8 [rows, cols/2] (e2m1, low nibble 1st)  ``<name>_scale`` uint8 E8M0
                                                             [rows, cols/32]
nvfp4           uint8 [rows, cols/2]                         ``<name>_scale`` float8_e4m3fn
                                                             [rows, cols/16], ``<name>_scale_2``
                                                             float32 [1]
raw             as given                                     -
==============  ===========================================  ===============================

For a master ``x.weight`` the companions are ``x.weight_scale`` (vLLM fp8 / compressed-
tensors / ModelOpt), ``x.weight_scale_inv`` (DeepSeek-V3) and ``x.weight_scale_2`` (ModelOpt
NVFP4's tensor scale). Every scale is a dequantization multiplier.

Which tensors are quantized (fp8 and 4-bit kinds): 2-D floating-point tensors whose name ends
in ``weight``, whose last dimension is a multiple of the block (32 for mxfp4, 16 for nvfp4;
fp8 takes any width), and that match no keep pattern. Everything else floating-point is
stored as bfloat16: engines run only Linear weights in quantized kernels and look their scales
up as ``<prefix>.weight_scale``; norms, embeddings, biases and the LM head are small and
precision-sensitive. Default keep patterns: ``*norm*``, ``*embed*``, ``*lm_head*``,
``*bias*`` (1-D tensors never qualify). Explicit patterns replace the defaults. In the fp16
kind the defaults keep nothing (fp16 engines load every float tensor as fp16) and explicit
patterns keep matches in bf16. Non-float tensors (integer buffers) are stored unchanged.

Scale policies (DESIGN.md, "Scales are the hazard"):

- ``recompute``: fresh scales from the current values every version (the dense baseline).
- ``fixed``: scales kept from the last anchor; recomputed at ``anchor=True`` (or the first time
  a tensor is seen), and for a block (or tensor) whose values would overflow the format under
  the kept scale, when only that block's scale moves (nvfp4: when a block cannot be held even
  with the largest block scale, the tensor scale and all its block scales are recomputed).
- ``pow2``: fresh scales rounded up to powers of two, a pure function of the current values
  that moves only when an amax crosses a power of two. E8M0 is already pow2; for nvfp4 both the
  tensor and the block scales are powers of two (exact in e4m3 up to 256).

Invariants:
- Deterministic: the stored bytes depend only on the master values, the spec, and (for
  ``fixed``) the kept scales, which are exactly the scale tensors of the previous served view,
  so :meth:`Projector.resume_from` restores the state bit for bit.
- Casts round to nearest even (torch's casts for bf16/fp16/fp8, ours for e2m1); out-of-range
  values saturate in fp8/4-bit (fp16 follows torch: +-Inf). NaN/Inf: see formats_fp8/fp4.
- Returned tensors are contiguous, on the master's device, and never alias the master.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from weftboard.cuda import formats_fp4 as fp4
from weftboard.cuda import formats_fp8 as fp8
from weftboard.proto.errors import FailedPrecondition, InvalidArgument
from weftboard.proto.v1 import board_pb2 as pb

KINDS = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4", "raw")
GRANULARITIES = ("tensor", "block128")
POLICIES = ("fixed", "pow2", "recompute")
DEFAULT_KEEP_BF16 = ("*norm*", "*embed*", "*lm_head*", "*bias*")
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2")
_QUANTIZED_KINDS = ("fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4")


def is_scale_tensor(name: str) -> bool:
    """True for the stored scale tensors this module writes (``*weight_scale[_inv|_2]``)."""
    return name.endswith(SCALE_SUFFIXES)


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype name without "torch.", as TensorSpec.dtype carries it."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------
# the spec
# ---------------------------------------------------------------------------


def _proto_maps() -> tuple[dict, dict, dict]:
    kinds = {
        "bf16": pb.FORMAT_KIND_BF16,
        "fp16": pb.FORMAT_KIND_FP16,
        "fp8_e4m3": pb.FORMAT_KIND_FP8_E4M3,
        "fp8_e5m2": pb.FORMAT_KIND_FP8_E5M2,
        "mxfp4": pb.FORMAT_KIND_MXFP4,
        "nvfp4": pb.FORMAT_KIND_NVFP4,
        "raw": pb.FORMAT_KIND_RAW,
    }
    granularities = {"tensor": pb.SCALE_GRANULARITY_PER_TENSOR, "block128": pb.SCALE_GRANULARITY_BLOCK_128}
    policies = {
        "recompute": pb.SCALE_POLICY_RECOMPUTE,
        "fixed": pb.SCALE_POLICY_FIXED_BETWEEN_ANCHORS,
        "pow2": pb.SCALE_POLICY_POWER_OF_TWO,
    }
    return kinds, granularities, policies


@dataclass(frozen=True)
class ServedFormatSpec:
    """How a run's served checkpoint stores each weight (the ServedFormat message, typed)."""

    kind: str
    scale_granularity: str = "tensor"
    scale_policy: str = "fixed"
    keep_bf16_patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"served format kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.scale_granularity not in GRANULARITIES:
            raise InvalidArgument(
                f"scale_granularity {self.scale_granularity!r} is not one of {', '.join(GRANULARITIES)}"
            )
        if self.scale_granularity == "block128" and not self.kind.startswith("fp8"):
            raise InvalidArgument(
                f"scale_granularity 'block128' applies to fp8 kinds only, not {self.kind!r}; "
                "the 4-bit formats have their own block sizes"
            )
        if self.scale_policy not in POLICIES:
            raise InvalidArgument(f"scale_policy {self.scale_policy!r} is not one of {', '.join(POLICIES)}")
        patterns = tuple(self.keep_bf16_patterns)
        if not all(isinstance(p, str) and p for p in patterns):
            raise InvalidArgument("keep_bf16_patterns must be non-empty glob strings")
        object.__setattr__(self, "keep_bf16_patterns", patterns)

    @classmethod
    def from_proto(cls, msg) -> ServedFormatSpec:
        """From a board_pb2.ServedFormat; unspecified granularity/policy take the defaults."""
        kinds, granularities, policies = _proto_maps()
        by_kind = {v: k for k, v in kinds.items()}
        if msg.kind not in by_kind:
            raise InvalidArgument(f"served_format.kind {msg.kind} is unspecified or unknown; name a FormatKind")
        granularity = {v: k for k, v in granularities.items()}.get(msg.scale_granularity, "tensor")
        policy = {v: k for k, v in policies.items()}.get(msg.scale_policy, "fixed")
        return cls(by_kind[msg.kind], granularity, policy, tuple(msg.keep_bf16_patterns))

    def to_proto(self):
        """A board_pb2.ServedFormat with every field explicit."""
        kinds, granularities, policies = _proto_maps()
        return pb.ServedFormat(
            kind=kinds[self.kind],
            scale_granularity=granularities[self.scale_granularity],
            scale_policy=policies[self.scale_policy],
            keep_bf16_patterns=list(self.keep_bf16_patterns),
        )


# ---------------------------------------------------------------------------
# per-tensor plan: what a master tensor becomes
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    codec: str  # "copy" (stored as given), "cast", "fp8", "mxfp4", "nvfp4"
    stored: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


def _kept_in_bf16(spec: ServedFormatSpec, name: str) -> bool:
    patterns = spec.keep_bf16_patterns
    if not patterns:
        patterns = () if spec.kind == "fp16" else DEFAULT_KEEP_BF16
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _plan(spec: ServedFormatSpec, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> _Plan:
    if spec.kind == "raw" or not dtype.is_floating_point:
        return _Plan("copy", ((name, dtype, shape),))
    if spec.kind in ("bf16", "fp16"):
        target = torch.float16 if spec.kind == "fp16" and not _kept_in_bf16(spec, name) else torch.bfloat16
        return _Plan("cast", ((name, target, shape),))
    bf16 = _Plan("cast", ((name, torch.bfloat16, shape),))
    if len(shape) != 2 or not name.endswith("weight") or _kept_in_bf16(spec, name):
        return bf16
    rows, cols = shape
    if spec.kind in fp8.FP8_DTYPES:
        values = (name, fp8.FP8_DTYPES[spec.kind], shape)
        if spec.scale_granularity == "block128":
            return _Plan("fp8", (values, (name + "_scale_inv", torch.float32, fp8.block_grid(shape))))
        return _Plan("fp8", (values, (name + "_scale", torch.float32, (1,))))
    if spec.kind == "mxfp4":
        if cols % fp4.MX_BLOCK:
            return bf16
        return _Plan(
            "mxfp4",
            ((name, torch.uint8, (rows, cols // 2)), (name + "_scale", torch.uint8, (rows, cols // fp4.MX_BLOCK))),
        )
    if cols % fp4.NV_BLOCK:
        return bf16
    return _Plan(
        "nvfp4",
        (
            (name, torch.uint8, (rows, cols // 2)),
            (name + "_scale", torch.float8_e4m3fn, (rows, cols // fp4.NV_BLOCK)),
            (name + "_scale_2", torch.float32, (1,)),
        ),
    )


# ---------------------------------------------------------------------------
# the projector
# ---------------------------------------------------------------------------


class Projector:
    """Projects master tensors to stored tensors, holding the scale state between versions.

    The state is the scale tensors of the last projected version, per master name; the
    "fixed" policy needs them, the others ignore them. Calls for different tensors may run
    on different threads (each touches its own entry).
    """

    def __init__(self, spec: ServedFormatSpec) -> None:
        self.spec = spec
        self._kept: dict[str, tuple[torch.Tensor, ...]] = {}
        self._lock = threading.Lock()

    # -- layout ------------------------------------------------------------------

    def plan(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, str, tuple[int, ...]]]:
        """Stored (name, dtype name, shape) of one master tensor, without its values."""
        return [(n, dtype_name(d), s) for n, d, s in _plan(self.spec, name, tuple(shape), dtype).stored]

    def layout(self, master: Mapping[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype name, stored shape) of every stored tensor, in served order.

        Reads only names, shapes and dtypes, so meta tensors work.
        """
        out: list[tuple[str, str, tuple[int, ...]]] = []
        for name, tensor in master.items():
            out.extend(self.plan(name, tuple(tensor.shape), tensor.dtype))
        _check_unique(n for n, _, _ in out)
        return out

    # -- values ------------------------------------------------------------------

    def project_tensor(self, name: str, master: torch.Tensor, *, anchor: bool) -> dict[str, torch.Tensor]:
        """The stored tensors this master tensor becomes, in layout order."""
        plan = _plan(self.spec, name, tuple(master.shape), master.dtype)
        if plan.codec in ("copy", "cast"):
            ((stored_name, dtype, _),) = plan.stored
            return {stored_name: master.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)}
        x = master.detach().float()
        kept = None if anchor else self._kept_for(name, plan, master.device)
        policy = self.spec.scale_policy
        if plan.codec == "fp8":
            dtype = plan.stored[0][1]
            granularity = self.spec.scale_granularity
            scale = fp8.fp8_scales(x, dtype, granularity, policy, kept[0] if kept else None)
            values = (fp8.fp8_encode(x, scale, dtype), scale.contiguous())
        elif plan.codec == "mxfp4":
            scale = fp4.mxfp4_scales(x, policy, kept[0] if kept else None)
            values = (fp4.mxfp4_encode(x, scale), scale.contiguous())
        else:
            block_scale, tensor_scale = fp4.nvfp4_scales(x, policy, kept)
            values = (fp4.nvfp4_encode(x, block_scale, tensor_scale), block_scale.contiguous(), tensor_scale)
        kept_now = tuple(v.detach().clone() for v in values[1:])  # the caller may patch its view in place
        with self._lock:
            self._kept[name] = kept_now
        return {stored_name: v for (stored_name, _, _), v in zip(plan.stored, values, strict=False)}

    def project(self, master: Mapping[str, torch.Tensor], *, anchor: bool) -> dict[str, torch.Tensor]:
        """The whole served view, in master order (each tensor's stored tensors in order)."""
        self.layout({n: t for n, t in master.items()})  # refuse name collisions before any work
        served: dict[str, torch.Tensor] = {}
        for name, tensor in master.items():
            served.update(self.project_tensor(name, tensor, anchor=anchor))
        return served

    # -- scale state ----------------------------------------------------------------

    def resume_from(self, served: Mapping[str, torch.Tensor]) -> None:
        """Re-seed the kept scales from a served view (the last anchor or version).

        Every quantized tensor of the view must carry the companions this spec writes, with
        their dtypes; a view of another format is refused rather than half-used.
        """
        kept: dict[str, tuple[torch.Tensor, ...]] = {}
        for name in served:
            if is_scale_tensor(name) or self.spec.kind not in _QUANTIZED_KINDS:
                continue
            companions = self._companions(name)
            present = [suffix for suffix, _ in companions if name + suffix in served]
            if not present:
                continue
            if len(present) != len(companions):
                raise InvalidArgument(
                    f"served view has {', '.join(name + s for s in present)} but not all of "
                    f"{', '.join(name + s for s, _ in companions)}; it was not made with {self.spec}"
                )
            scales = []
            for suffix, dtype in companions:
                scale = served[name + suffix]
                if dtype is not None and scale.dtype != dtype:
                    raise InvalidArgument(
                        f"served view's {name + suffix} is {dtype_name(scale.dtype)}, but a "
                        f"{self.spec.kind} projection stores {dtype_name(dtype)}; resume from a view "
                        "made with this served format"
                    )
                scales.append(scale.detach().clone())
            kept[name] = tuple(scales)
        with self._lock:
            self._kept = kept

    def _companions(self, name: str) -> list[tuple[str, torch.dtype | None]]:
        kind = self.spec.kind
        if kind in fp8.FP8_DTYPES:
            suffix = "_scale_inv" if self.spec.scale_granularity == "block128" else "_scale"
            return [(suffix, torch.float32)]
        if kind == "mxfp4":
            return [("_scale", torch.uint8)]
        return [("_scale", torch.float8_e4m3fn), ("_scale_2", torch.float32)]

    def _kept_for(self, name: str, plan: _Plan, device: torch.device) -> tuple[torch.Tensor, ...] | None:
        with self._lock:
            kept = self._kept.get(name)
        if kept is None:
            return None
        for tensor, (stored_name, dtype, shape) in zip(kept, plan.stored[1:], strict=False):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise FailedPrecondition(
                    f"kept scale {stored_name} is {dtype_name(tensor.dtype)}{list(tensor.shape)} but this "
                    f"tensor needs {dtype_name(dtype)}{list(shape)}: the master changed shape since the "
                    "scales were kept; project with anchor=True to start fresh scales"
                )
        if kept[0].device != device:
            kept = tuple(t.to(device) for t in kept)
            with self._lock:
                self._kept[name] = kept
        return kept


def _check_unique(names: Iterator[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidArgument(
                f"stored tensor name {name!r} is produced twice: a master tensor has the name a "
                "projected companion (scale) would take; rename it or use the raw format"
            )
        seen.add(name)


# ---------------------------------------------------------------------------
# reading stored tensors back
# ---------------------------------------------------------------------------


def dequantize(stored: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """float32 values of master ``name`` from a served view; the format is read off dtypes."""
    if name not in stored:
        raise InvalidArgument(f"served view has no tensor {name!r}")
    values = stored[name]
    scale = stored.get(name + "_scale")
    scale_inv = stored.get(name + "_scale_inv")
    if values.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        multiplier = scale_inv if scale_inv is not None else scale
        if multiplier is None:
            raise InvalidArgument(f"fp8 tensor {name!r} has neither {name}_scale nor {name}_scale_inv")
        return fp8.fp8_dequantize(values, multiplier.float())
    if values.dtype == torch.uint8 and scale is not None:
        if scale.dtype == torch.uint8:
            return fp4.mxfp4_dequantize(values, scale)
        tensor_scale = stored.get(name + "_scale_2")
        return fp4.nvfp4_dequantize(values, scale, tensor_scale)
    return values.float()


def dequantize_view(served: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float32 master-shaped tensors of a whole served view (scales folded in)."""
    return {name: dequantize(served, name) for name in served if not is_scale_tensor(name)}


# ---------------------------------------------------------------------------
# density of a transition
# ---------------------------------------------------------------------------


class Density(NamedTuple):
    """Stored elements whose bytes differ between two served views."""

    changed: int  # all changed elements, scale tensors included
    total: int  # all stored elements, scale tensors included
    scale_changed: int  # the part of `changed` that is in scale tensors

    @property
    def fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0


_RAW_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_elements(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """0-d count of elements whose raw bits differ (so -0 vs +0 counts, NaN == same NaN)."""
    bits = _RAW_BITS[old.element_size()]
    a = old.reshape(-1).view(bits)
    b = new.reshape(-1).to(old.device).view(bits)
    return (a != b).sum()


def transition_density(old_view: Mapping[str, torch.Tensor], new_view: Mapping[str, torch.Tensor]) -> Density:
    """Changed/total stored elements from one served version to the next, scales included."""
    if list(old_view) != list(new_view):
        raise InvalidArgument("the two served views have different tensor names or order")
    changed = scale_changed = total = 0
    for name, old in old_view.items():
        new = new_view[name]
        if old.dtype != new.dtype or old.shape != new.shape:
            raise InvalidArgument(
                f"{name} is {dtype_name(old.dtype)}{list(old.shape)} in one view and "
                f"{dtype_name(new.dtype)}{list(new.shape)} in the other"
            )
        count = int(changed_elements(old, new))
        changed += count
        total += old.numel()
        if is_scale_tensor(name):
            scale_changed += count
    return Density(changed, total, scale_changed)


# ---------------------------------------------------------------------------
# test models
# ---------------------------------------------------------------------------


def make_test_master(
    *,
    layers: int = 2,
    hidden: int = 256,
    intermediate: int = 512,
    vocab: int = 1024,
    std: float = 0.02,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """A small Llama-shaped master state dict with Llama names (deterministic from ``seed``).

    Weights are normal(0, std) with a few 10x outliers per matrix, as trained LLM weights
    have; norms are around 1. Sizes are multiples of 128 so every format quantizes them.
    """
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=gen) * std
        outliers = torch.randint(0, rows * cols, (max(1, rows * cols // 2000),), generator=gen)
        w.view(-1)[outliers] *= 10.0
        return w

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.05 * torch.randn(size, generator=gen)

    master: dict[str, torch.Tensor] = {"model.embed_tokens.weight": matrix(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        master[p + "input_layernorm.weight"] = norm(hidden)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            master[p + f"self_attn.{proj}.weight"] = matrix(hidden, hidden)
        master[p + "post_attention_layernorm.weight"] = norm(hidden)
        master[p + "mlp.gate_proj.weight"] = matrix(intermediate, hidden)
        master[p + "mlp.up_proj.weight"] = matrix(intermediate, hidden)
        master[p + "mlp.down_proj.weight"] = matrix(hidden, intermediate)
    master["model.norm.weight"] = norm(hidden)
    master["lm_head.weight"] = matrix(vocab, hidden)
    return {name: t.to(device=device, dtype=dtype) for name, t in master.items()}


def adamw_steps(
    master: Mapping[str, torch.Tensor],
    steps: int,
    *,
    lr: float = 3e-6,
    weight_decay: float = 0.01,
    seed: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the fp32 master after each of ``steps`` real torch AdamW steps on random gradients.

    Gradients are fresh normal noise per step: Adam normalises them, so each parameter moves
    by about ``lr`` per step, which is what makes served bits change sparsely.
    """
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter(t.detach().float().cpu().clone()) for n, t in master.items()}
    optimizer = torch.optim.AdamW(params.values(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        yield {n: p.detach().clone() for n, p in params.items()}


def make_served_view(
    spec: ServedFormatSpec | str, master: Mapping[str, torch.Tensor] | None = None, **model: object
) -> dict[str, torch.Tensor]:
    """A served view of a test model in one call (fresh scales, as at an anchor)."""
    if isinstance(spec, str):
        spec = ServedFormatSpec(spec)
    if master is None:
        master = make_test_master(**model)  # type: ignore[arg-type]
    return Projector(spec).project(master, anchor=True)
