"""``weftboard bench codec``: patch size and CPU speed on a realistic one-step update.

What it builds: a Llama-shaped fp32 master (embeddings and LM head 32000 x 512, matrices with
std 0.02 and a few outliers, norms near 1), one real ``torch.optim.AdamW`` step at lr 3e-6 on
random gradients (Adam's first step normalises them, so every parameter moves by about the
learning rate), then the served projection of both versions (``weftboard.cuda.formats``).

What it measures, all in the same run so the ratios are meaningful on any machine:
- ``bytes_per_change``: the measured encoding's whole patch (container included) per changed
  stored element (``--encoding``: ``default`` (``huffman`` streams); ``compact``, whose
  ``context_huffman`` streams code 16-bit floats by the old value's magnitude and so can beat the
  i.i.d. bound below; or ``context``, the same classes with rANS-coded values);
  ``baseline_bytes_per_change`` the same for int32 positions + raw values.
- ``entropy_bound_bytes_per_change``: positions as i.i.d. bits at the measured density
  (``H(p)/p`` bits per change) plus the empirical (order-0) entropy of the value differences
  ``new_bits - old_bits`` over all changes; a code that beats it must exploit structure beyond
  both.
- ``context_bound_bytes_per_change``: a context-conditional bound estimated on the same patch:
  whether each element changed given its old value's magnitude class and whether its left
  neighbour changed, plus each difference given its class (empirical conditional entropies,
  also given apart as ``context_bound_position_bits_per_change`` and ``..._value_bits_...``).
- ``diff_encode_gbps`` / ``decode_apply_gbps``: served bytes per second of ``encode_patch``
  (diff + encode, tensor by tensor) and ``apply_patch_`` (decode, validate, write in place),
  best of ``--repeat`` rounds (5: on a shared two-core host one operation in three rounds
  often had no quiet one, the copy as often as the codec); ``copy_gbps`` is ``tensor.clone()`` of the same tensors, and
  ``copy_into_gbps`` a ``copy_`` into preallocated memory (the stricter yardstick). The same
  three as the median over the rounds (``..._gbps_median``, and the codec's against the
  clone's, ``..._vs_copy_median``): a cost that only some rounds pay (fresh memory faulted in,
  a busy minute) moves these and not the best.
- ``lossless``: true only if every applied result (default and baseline) equals the new
  served view bit for bit and ``revert`` restored the old one bit for bit.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from weftboard.cuda import context_codec, formats
from weftboard.cuda.codec import apply_patch_, encode_patch, read_patch_info
from weftboard.cuda.diff import diff_tensor
from weftboard.cuda.digest import dtype_name, root_digest, tensor_digest
from weftboard.cuda.tensor_bits import bits_view, unsigned_np

FORMAT_KINDS = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}


def model_shape(params: int) -> dict[str, int]:
    """Layer count and widths for about ``params`` parameters (32000 x 512 embeddings from 40M up)."""
    if params >= 40_000_000:
        hidden, inter, vocab = 512, 1536, 32000
    else:
        hidden, inter, vocab = 128, 384, 2048
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((params - fixed) / per_layer))
    return {"layers": layers, "hidden": hidden, "intermediate": inter, "vocab": vocab}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return bits_view(t)


def views_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and torch.equal(_bits(a[n]), _bits(b[n])) for n in a
    )


def entropy_bound_bits(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> tuple[float, int, int]:
    """(bound in bits, changes, elements): i.i.d. position bits + order-0 entropy of differences."""
    counts: dict[tuple[int, int], int] = {}
    changes = elements = 0
    for name in new:
        d = diff_tensor(old[name], new[name])
        elements += d.numel
        changes += d.changed
        if not d.changed:
            continue
        o = unsigned_np(d.old_bits).astype(np.uint64)
        w = unsigned_np(d.new_bits).astype(np.uint64)
        width = d.old_bits.element_size()
        mask = np.uint64((1 << (8 * width)) - 1)
        vals, cnt = np.unique((w - o) & mask, return_counts=True)
        for v, c in zip(vals.tolist(), cnt.tolist(), strict=True):
            counts[(width, v)] = counts.get((width, v), 0) + c
    if changes == 0:
        return 0.0, 0, elements
    p = changes / elements
    h_pos = 0.0 if p >= 1.0 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) * elements
    c = np.array(list(counts.values()), dtype=np.float64)
    q = c / changes
    h_val = float(-(c * np.log2(q)).sum())
    return h_pos + h_val, changes, elements


def _cond_entropy_bits(keys: np.ndarray, given: np.ndarray) -> float:
    """Empirical ``H(keys | given)`` in bits, summed over the samples (both int64 arrays)."""
    if keys.size == 0:
        return 0.0
    _, joint = np.unique(np.stack([given, keys]), axis=1, return_counts=True)
    _, marg = np.unique(given, return_counts=True)
    j = joint.astype(np.float64)
    m = marg.astype(np.float64)
    return float(-(j * np.log2(j)).sum() + (m * np.log2(m)).sum())


def context_bound_bits(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """(position bits, value bits) of a context-conditional bound on the same patch: whether an
    element changed given its old value's class (``context_codec``'s thresholds, for 16-bit
    floats; one class otherwise) and whether its left neighbour changed; each change's
    difference given its class. Empirical conditional entropies, per tensor."""
    pos_bits = val_bits = 0.0
    for name in new:
        a = unsigned_np(bits_view(old[name]).reshape(-1)).astype(np.int64)
        b = unsigned_np(bits_view(new[name]).reshape(-1)).astype(np.int64)
        changed = a != b
        if not changed.any():
            continue
        cls = np.zeros(a.size, np.int64)
        if context_codec.supports(old[name].dtype):
            thr = context_codec.choose_thresholds(unsigned_np(bits_view(old[name]).reshape(-1)), old[name].dtype)
            cls = np.searchsorted(thr, a & 0x7FFF, side="right").astype(np.int64)
        left = np.concatenate([[False], changed[:-1]])
        ctx = cls * 2 + left
        counts = np.bincount(ctx * 2 + changed, minlength=2 * int(ctx.max() + 1) + 2).reshape(-1, 2).astype(np.float64)
        rows = counts.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(counts > 0, counts * np.log2(counts / rows[:, None]), 0.0)
        pos_bits -= float(terms.sum())
        width = old[name].element_size()
        d = (b[changed] - a[changed]) & ((1 << (8 * width)) - 1) if width < 8 else b[changed] - a[changed]
        val_bits += _cond_entropy_bits(d, cls[changed])
    return pos_bits, val_bits


def _root_of(tensors: Mapping[str, torch.Tensor]) -> str:
    """The root digest over ``tensors``: what a subscriber computes to verify a version."""
    return root_digest([(n, dtype_name(t.dtype), tuple(t.shape), tensor_digest(t)) for n, t in tensors.items()])


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Best wall time of ``repeat`` calls after one untimed warm-up call (JIT caches, allocator)."""
    out = fn()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(
    fmt: str = "bf16",
    params: int = 55_000_000,
    repeat: int = 5,
    seed: int = 0,
    adam_steps: int = 1,
    encoding: str = "default",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    if fmt not in FORMAT_KINDS:
        raise ValueError(f"--format must be one of {', '.join(FORMAT_KINDS)}, got {fmt!r}")
    kind = FORMAT_KINDS[fmt]
    shape = model_shape(params)
    t0 = time.perf_counter()
    master = formats.make_test_master(**shape, seed=seed)
    nparams = sum(t.numel() for t in master.values())
    if adam_steps < 1:
        raise ValueError("adam_steps must be at least 1")
    # The transition measured is the last step: from the master after adam_steps - 1 steps to
    # the master after adam_steps (1: the first step, where Adam's normalized step is exactly
    # +-lr; later steps average noisy gradients, move less, and change fewer bits).
    *_, before, stepped = [master, *formats.adamw_steps(master, adam_steps, lr=3e-6, seed=seed + 1)]
    if adam_steps > 1:
        master = before
    del before
    spec = formats.ServedFormatSpec(kind)
    proj = formats.Projector(spec)
    old = proj.project(master, anchor=True)
    new = proj.project(stepped, anchor=False)
    density = formats.transition_density(old, new)
    extra: dict[str, Any] = {}
    if kind in ("fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4"):
        rec = formats.Projector(formats.ServedFormatSpec(kind, scale_policy="recompute"))
        r_old = rec.project(master, anchor=True)
        r_new = rec.project(stepped, anchor=False)
        extra["density_recompute_scales"] = formats.transition_density(r_old, r_new).fraction
        extra["scale_changed"] = density.scale_changed
        del r_old, r_new
    del master, stepped
    served_bytes = sum(t.numel() * t.element_size() for t in new.values())
    log(f"model: {nparams / 1e6:.1f}M fp32 params, {shape}, served {fmt}: {served_bytes / 1e6:.1f} MB "
        f"in {len(new)} tensors (built in {time.perf_counter() - t0:.1f}s)")
    log(f"density: {density.changed} of {density.total} stored elements changed ({density.fraction:.4%}), "
        f"{density.scale_changed} in scale tensors"
        + (f"; with scales recomputed every step: {extra['density_recompute_scales']:.4%}" if extra else ""))

    manifest = [(n, dtype_name(t.dtype), tuple(t.shape), tensor_digest(t)) for n, t in new.items()]
    root = root_digest(manifest)

    def encode(encoding: str):
        return encode_patch(((n, old[n], new[n]) for n in new), base_version=1, target_version=2,
                            target_root=root, encoding=encoding)

    baseline = encode("baseline")
    tensors = list(new.values())
    dsts = [torch.empty_like(t) for t in tensors]

    def fresh():
        return {n: t.clone() for n, t in old.items()}

    # Every round times all four operations back to back and the best of each is kept, so a
    # burst of load on a shared machine hits the yardstick and the codec alike. Round 0 warms
    # up (JIT caches, allocator) and is not timed.
    rounds: dict[str, list[float]] = {"enc": [], "apply": [], "clone": [], "copy": []}
    lossless = True
    patch = None
    for i in range(repeat + 1):
        t1 = time.perf_counter()
        clones = [t.clone() for t in tensors]
        t_clone = time.perf_counter() - t1
        del clones
        t1 = time.perf_counter()
        for d, t in zip(dsts, tensors, strict=True):
            d.copy_(t)
        t_copy = time.perf_counter() - t1
        t1 = time.perf_counter()
        patch = encode(encoding)
        t_enc = time.perf_counter() - t1
        target = fresh()
        t1 = time.perf_counter()
        applied = apply_patch_(target, patch.data)
        t_apply = time.perf_counter() - t1
        lossless &= views_equal(target, new)
        applied.revert()
        lossless &= views_equal(target, old)
        if i:
            for key, value in (("enc", t_enc), ("apply", t_apply), ("clone", t_clone), ("copy", t_copy)):
                rounds[key].append(value)
    del dsts
    assert patch is not None
    changes = sum(patch.changed.values())
    if changes != density.changed:
        raise AssertionError(f"codec saw {changes} changes, the formats module counts {density.changed}")
    target = fresh()
    apply_patch_(target, baseline.data)
    lossless &= views_equal(target, new)
    t_digest, _ = _best(functools.partial(_root_of, target), repeat)
    del target
    t_enc, t_apply, t_clone, t_copy = (min(rounds[key]) for key in ("enc", "apply", "clone", "copy"))

    bound_bits, _, _ = entropy_bound_bits(old, new)
    ctx_pos_bits, ctx_val_bits = context_bound_bits(old, new)
    info = read_patch_info(patch.data)
    modes: dict[str, int] = {}
    for ti in info.tensors:
        modes[ti.mode] = modes.get(ti.mode, 0) + 1
    gb = served_bytes / 1e9
    result: dict[str, Any] = {
        "format": fmt,
        "encoding": encoding,
        "params": nparams,
        "adam_steps": adam_steps,
        "density": density.fraction,
        "changed": changes,
        "patch_bytes": len(patch.data),
        "baseline_patch_bytes": len(baseline.data),
        "bytes_per_change": len(patch.data) / changes if changes else 0.0,
        "entropy_bound_bytes_per_change": bound_bits / 8 / changes if changes else 0.0,
        "context_bound_bytes_per_change": (ctx_pos_bits + ctx_val_bits) / 8 / changes if changes else 0.0,
        "context_bound_position_bits_per_change": ctx_pos_bits / changes if changes else 0.0,
        "context_bound_value_bits_per_change": ctx_val_bits / changes if changes else 0.0,
        "baseline_bytes_per_change": len(baseline.data) / changes if changes else 0.0,
        "ratio_vs_baseline": len(baseline.data) / len(patch.data),
        "diff_encode_gbps": gb / t_enc,
        "decode_apply_gbps": gb / t_apply,
        "copy_gbps": gb / t_clone,
        "copy_into_gbps": gb / t_copy,
        "digest_gbps": gb / t_digest,
        "lossless": bool(lossless),
        **extra,
    }
    result["diff_encode_vs_copy"] = result["diff_encode_gbps"] / result["copy_gbps"]
    result["decode_apply_vs_copy"] = result["decode_apply_gbps"] / result["copy_gbps"]
    for name, key in (("diff_encode", "enc"), ("decode_apply", "apply"), ("copy", "clone")):
        result[f"{name}_gbps_median"] = gb / statistics.median(rounds[key])
    result["diff_encode_vs_copy_median"] = result["diff_encode_gbps_median"] / result["copy_gbps_median"]
    result["decode_apply_vs_copy_median"] = result["decode_apply_gbps_median"] / result["copy_gbps_median"]
    if changes:
        result["bound_ratio"] = result["bytes_per_change"] / result["entropy_bound_bytes_per_change"]
    log(f"patch: {len(patch.data)} bytes, {result['bytes_per_change']:.4f} B/change "
        f"(i.i.d. entropy bound {result['entropy_bound_bytes_per_change']:.4f}, x{result.get('bound_ratio', 0):.3f}; "
        f"context bound {result['context_bound_bytes_per_change']:.4f}: "
        f"{result['context_bound_position_bits_per_change']:.2f} position + "
        f"{result['context_bound_value_bits_per_change']:.2f} value bits); "
        f"baseline {len(baseline.data)} bytes, {result['baseline_bytes_per_change']:.3f} B/change; "
        f"ratio {result['ratio_vs_baseline']:.2f}x; stream modes {modes}")
    log(f"speed (served GB/s, best of {repeat}): diff+encode {result['diff_encode_gbps']:.2f}, "
        f"decode+apply {result['decode_apply_gbps']:.2f}, clone {result['copy_gbps']:.2f}, "
        f"copy_ into preallocated {result['copy_into_gbps']:.2f}, digest {result['digest_gbps']:.2f}; "
        f"median of the rounds: {result['diff_encode_gbps_median']:.2f}, {result['decode_apply_gbps_median']:.2f}, "
        f"clone {result['copy_gbps_median']:.2f}; lossless={result['lossless']}")
    return result


def main(fmt: str, params: int, repeat: int, as_json: bool, adam_steps: int = 1, encoding: str = "default") -> dict[str, Any]:
    result = run(fmt=fmt, params=params, repeat=repeat, adam_steps=adam_steps, encoding=encoding)
    if as_json:
        print(json.dumps(result))
    return result
