"""GPU benchmark of the patch engine: ``python -m weftboard.cuda.bench.gpu_bench``.

One command that builds, checks and times everything on an NVIDIA GPU in a few minutes:

1. builds a 7B-shaped bf16 tensor set on the device (32 Llama layers, 4096 hidden, 11008
   intermediate, 32000 vocabulary: about 6.7e9 elements, 13.5 GB) and one simulated update at
   about 1% clustered density (changed elements sit in hot 256-element segments, each moved by
   +-1 unit in the last place, a few by far jumps);
2. times, with CUDA events, the device copy (``tensor.copy_``, the yardstick), the Triton diff
   (staged in-block compaction, one host sync per batch) at the launch's warps per program and
   at the others of ``--diff-warps`` (``triton_compile`` reports each one's registers; this
   measures which is fastest), the torch-native diff baseline
   (``ne`` + ``nonzero`` + gather, one sync per tensor), the Triton in-place apply and the
   torch-native apply (``index_copy_``);
3. encodes the deltas into a patch (entropy coding on CPU threads, documented in codec.py),
   times the Triton decode+apply of its ``huffman`` streams on the device (``triton_huffman``:
   streams already uploaded, one program per tile) and checks it against the CPU decoder's
   bytes, then decodes + applies the patch end to end with ``apply_patch_`` into a copy of the
   old set (on a GPU the huffman streams take the same device decoder), and times the Triton
   scan of the huffman encoder plus its host finish (``triton_huffman_scan``) on the same
   pairs against ``copy_``, its streams checked against the CPU encoder's bytes;
4. checks that every applied tensor equals the new set bit for bit (and the torch baseline's
   result too), and prints a short table with GB/s of served bytes and % of copy bandwidth,
   then each Triton kernel's registers and spills as the device loaded it (``kernel_resources``).

``cuda/device_check.sh`` wraps it for a lent GPU machine: one call that runs it tiny, then
full, then the CUDA-only tests, from the checkout with nothing installed.

Without a CUDA device it exits with status 2 and says so. For a dry run of the same code path
on a CPU, ``TRITON_INTERPRET=1 python -m weftboard.cuda.bench.gpu_bench --device cpu --tiny`` runs the
Triton kernels in the interpreter on a tiny set (timings there mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from weftboard.cuda.apply import DEVICE_DECODE_ENV
from weftboard.cuda.bench.triton_compile import warps_list
from weftboard.cuda.codec import CODEC_TILE, apply_patch_, encode_deltas
from weftboard.cuda.container import read_container
from weftboard.cuda.decode import apply_tile_stream_, parse_tile_stream, stream_array
from weftboard.cuda.tensor_bits import bits_view, cpu_bits
from weftboard.cuda.tile_encode import encode_huffman


@dataclass
class Row:
    name: str
    seconds: float
    note: str = ""


class _Timer:
    """Wall time of a block on the device: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0

    def __enter__(self) -> _Timer:
        if self.cuda:
            torch.cuda.synchronize()
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0


def llama_shapes(layers: int, hidden: int, inter: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (hidden,)))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes.append((p + f"self_attn.{proj}.weight", (hidden, hidden)))
        shapes.append((p + "post_attention_layernorm.weight", (hidden,)))
        shapes.append((p + "mlp.gate_proj.weight", (inter, hidden)))
        shapes.append((p + "mlp.up_proj.weight", (inter, hidden)))
        shapes.append((p + "mlp.down_proj.weight", (hidden, inter)))
    shapes.append(("model.norm.weight", (hidden,)))
    shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def make_update(old: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """``old`` with about ``density`` of its elements changed, clustered in hot segments."""
    seg = 256
    n = old.numel()
    nseg = (n + seg - 1) // seg
    hot_fraction = 0.05
    hot = torch.rand(nseg, device=old.device, generator=gen) < hot_fraction
    mask = hot.repeat_interleave(seg)[:n] & (torch.rand(n, device=old.device, generator=gen) < density / hot_fraction)
    step = torch.where(torch.rand(n, device=old.device, generator=gen) < 0.5, 1, -1).to(torch.int16)
    far = torch.rand(n, device=old.device, generator=gen) < 0.001
    step = torch.where(far, torch.full_like(step, 4097), step)
    new = old.clone()
    bits = new.view(-1).view(torch.int16)
    bits.add_(step * mask.to(torch.int16))
    return new


def kernel_resources(fn: Any) -> list[str]:
    """What the driver reports for each form of a Triton kernel compiled in this process: its
    warps, registers and spilled registers, to set beside ``triton_compile``'s figures, made
    with no GPU. These are Triton internals (``device_caches``, ``n_regs``), so a failure reads
    as unavailable and costs the benchmark nothing."""
    try:
        lines = []
        for caches in fn.device_caches.values():
            for kernel in caches[0].values():
                kernel._init_handles()
                lines.append(f"{fn.__name__}: {kernel.metadata.num_warps} warps, {kernel.n_regs} registers, "
                             f"{kernel.n_spills} spilled")
        return lines or [f"{fn.__name__}: no compiled form"]
    except Exception as exc:
        return [f"{fn.__name__}: resources unavailable ({type(exc).__name__}: {exc})"]


def _same_as_torch(got: dict, ref: dict) -> bool:
    """Each tensor's Triton delta has the torch diff's positions and new bits."""
    return all(torch.equal(d.positions, ref[n][0]) and torch.equal(d.new_bits, ref[n][1]) for n, d in got.items())


def huffman_device_rows(patch_data: bytes, old: dict, new: dict, device: torch.device,
                        cpu_check_bytes: float) -> tuple[Row, bool, Any, str]:
    """Time the Triton decode+apply of the patch's ``huffman`` streams into a copy of ``old``
    (streams, tile rows and tables uploaded first, untimed; one host sync per tensor for its
    error codes, as ``triton_huffman.apply_tile_stream_cuda_`` has) and ``copy_`` of the same
    tensors, then check the result bitwise: every tensor against ``new``, and those that fit
    ``cpu_check_bytes`` in all also against the CPU decoder (``tile_decode``) applied to a host
    copy of ``old``. Returns the row, the check's verdict, the kernel (for
    ``kernel_resources``) and a line comparing the two on the decoded tensors' bytes."""
    from weftboard.cuda import triton_huffman  # optional dependency: triton

    c = read_container(patch_data)
    entries = [e for e in c.entries if e["mode"] == "huffman"]
    if device.type == "cpu":  # the interpreter takes milliseconds a change: a dry run decodes a few streams
        entries = sorted(entries, key=lambda e: e["changed"])
        entries = [e for i, e in enumerate(entries) if sum(x["changed"] for x in entries[:i + 1]) <= 600] or entries[:1]
    steps = {e["name"]: parse_tile_stream(e, stream_array(c.streams[e["name"]]), old[e["name"]].element_size())
             for e in entries}
    tiles = {n: triton_huffman.DeviceTiles(sp, device) for n, sp in steps.items()}
    target = {n: old[n].clone() for n in steps}
    rounds = 2 if device.type == "cuda" else 1  # on a GPU the first round compiles the kernel
    ok = True
    for rnd in range(rounds):
        if rnd:
            for n in steps:
                target[n].copy_(old[n])
        with _Timer(device) as t_dec:
            for n, dev in tiles.items():
                errs, _ = dev.launch(bits_view(target[n]), 1, dev.ns)
                ok &= not errs.any()
    ok &= all(torch.equal(bits_view(target[n]), bits_view(new[n])) for n in steps)
    checked = cpu_checked = 0
    for e in entries:
        n = e["name"]
        size = old[n].numel() * old[n].element_size()
        if checked + size > cpu_check_bytes:
            continue
        ref = old[n].to("cpu", copy=True)
        apply_tile_stream_(ref, e, steps[n], 1)
        ok &= torch.equal(bits_view(target[n]).cpu(), bits_view(ref))
        checked += size
        cpu_checked += 1
    nbytes = sum(old[n].numel() * old[n].element_size() for n in steps)
    dec, cp = _gbps(nbytes, t_dec.seconds), _gbps(nbytes, _copy_seconds({n: target[n] for n in steps}, new, device, rounds))
    changed = sum(e["changed"] for e in entries)
    row = Row("decode+apply, Triton huffman (device)", t_dec.seconds,
              f"{len(steps)} streams, {changed} changes; {cpu_checked} checked vs the CPU decoder")
    line = (f"triton huffman decode+apply on its {len(steps)} tensors ({nbytes / 1e9:.3g} GB): {dec:.1f} GB/s; "
            f"copy_ of the same tensors {cp:.1f} GB/s; ratio {dec / cp:.3f}")
    return row, ok, triton_huffman.huffman_apply_kernel, line


def huffman_scan_device_rows(old: dict, new: dict, device: torch.device,
                             cpu_check_bytes: float) -> tuple[Row, bool, tuple, str]:
    """Time the Triton scan of the ``huffman`` encoder plus the host finish
    (``triton_huffman_scan.encode_huffman_cuda``: three launches and two compact device-to-host
    copies per tensor, the host's ``tile_encode`` code after them) on every (old, new) pair, and
    ``copy_`` of the same tensors; then check the streams bytewise against the CPU encoder
    (``tile_encode.encode_huffman`` on host copies) on those tensors that fit
    ``cpu_check_bytes`` in all. Returns the row, the check's verdict, the kernels (for
    ``kernel_resources``) and a line comparing the two on the scanned tensors' bytes."""
    from weftboard.cuda import triton_huffman_scan as ths  # optional dependency: triton

    names = list(old)
    if device.type == "cpu":  # the interpreter takes milliseconds a change: a dry run scans a few tensors
        changes = {n: int((bits_view(old[n]) != bits_view(new[n])).sum()) for n in names}
        names = sorted(names, key=changes.__getitem__)
        names = [n for i, n in enumerate(names) if sum(changes[m] for m in names[:i + 1]) <= 600] or names[:1]
    rounds = 2 if device.type == "cuda" else 1
    if device.type == "cuda":  # compile the kernels first: one tensor of each form Triton specializes on
        for n in {old[n].numel() % 16 == 0: n for n in names}.values():
            ths.encode_huffman_cuda(old[n], new[n], CODEC_TILE)
    with _Timer(device) as t_scan:
        got = {n: ths.encode_huffman_cuda(old[n], new[n], CODEC_TILE) for n in names}
    ok = True
    checked = 0
    cpu_checked = 0
    for n in names:
        size = old[n].numel() * old[n].element_size()
        if checked + size > cpu_check_bytes:
            continue
        ref_changed, ref = encode_huffman(cpu_bits(old[n].cpu()), cpu_bits(new[n].cpu()), CODEC_TILE)
        changed, stream = got[n]
        ok &= changed == ref_changed and (stream is None) == (ref is None)
        ok &= ref is None or stream is None or stream.tobytes() == ref.tobytes()
        checked += size
        cpu_checked += 1
    nbytes = sum(old[n].numel() * old[n].element_size() for n in names)
    dst = {n: torch.empty_like(old[n]) for n in names}
    scan, cp = _gbps(nbytes, t_scan.seconds), _gbps(nbytes, _copy_seconds(dst, new, device, rounds))
    changed = sum(c for c, _ in got.values())
    row = Row("encode, Triton huffman scan + host finish", t_scan.seconds,
              f"{len(names)} tensors, {changed} changes; {cpu_checked} checked vs the CPU encoder")
    line = (f"triton huffman scan + host finish on its {len(names)} tensors ({nbytes / 1e9:.3g} GB): {scan:.1f} GB/s; "
            f"copy_ of the same tensors {cp:.1f} GB/s; ratio {scan / cp:.3f}")
    return row, ok, (ths.huffman_count_kernel, ths.huffman_place_kernel, ths.huffman_rice_kernel), line


def _copy_seconds(dst: dict, src: dict, device: torch.device, rounds: int) -> float:
    """Seconds of the last of ``rounds`` rounds of ``copy_`` from ``src`` into each tensor of ``dst``."""
    for _ in range(rounds):
        with _Timer(device) as t_copy:
            for n, t in dst.items():
                t.copy_(src[n])
    return t_copy.seconds


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (needs TRITON_INTERPRET=1; use with --tiny)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--tiny", action="store_true", help="2 layers of 256/512, vocab 1000: a functional dry run")
    ap.add_argument("--skip-codec", action="store_true", help="time only the device kernels, not the CPU entropy coder")
    ap.add_argument("--cpu-check-gb", type=float, default=2.0,
                    help="check the Triton huffman decode against the CPU decoder on tensors of up to this many GB in all")
    ap.add_argument("--diff-warps", type=warps_list, default=(4, 8, 32),
                    help="also time the Triton diff at these warps per program (comma-separated; the launch's "
                         "own, triton_kernels.DIFF_WARPS, is always timed), each checked against the torch diff")
    args = ap.parse_args(argv)
    sweep = args.diff_warps
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.vocab = 2, 256, 512, 1000

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("gpu_bench: no CUDA device is visible (torch.cuda.is_available() is False); "
                  "run it on a machine with an NVIDIA GPU, or dry-run it with "
                  "TRITON_INTERPRET=1 python -m weftboard.cuda.bench.gpu_bench --device cpu --tiny", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    elif args.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("gpu_bench: --device cpu needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
            return 2
        device = torch.device("cpu")
    else:
        print(f"gpu_bench: unknown --device {args.device!r}", file=sys.stderr)
        return 2

    from weftboard.cuda import triton_kernels as tk  # optional dependency: triton
    shapes = llama_shapes(args.layers, args.hidden, args.intermediate, args.vocab)
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.perf_counter()
    old = {n: (torch.randn(s, device=device, generator=gen) * 0.02).to(torch.bfloat16) for n, s in shapes}
    new = {n: make_update(t, args.density, gen) for n, t in old.items()}
    names = list(old)
    nbytes = sum(t.numel() * t.element_size() for t in old.values())
    numel = sum(t.numel() for t in old.values())
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"tensor set: {len(names)} bf16 tensors, {numel / 1e9:.2f}e9 elements, {nbytes / 1e9:.2f} GB "
          f"(built in {time.perf_counter() - t0:.1f}s)")

    rows: list[Row] = []
    dst = {n: torch.empty_like(t) for n, t in old.items()}
    for _ in range(2):  # the first round warms up (Triton JIT, allocator); the second is timed
        with _Timer(device) as t_copy:
            for n in names:
                dst[n].copy_(new[n])
    rows.append(Row("copy_ (device yardstick)", t_copy.seconds))
    del dst

    # Triton diff: all tensors of a layer in one batch (one host sync per batch)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.split(".")[2] if n.startswith("model.layers.") else n, []).append(n)
    batches = list(groups.values())

    def triton_diff(warps: int) -> tuple[float, dict]:
        """The seconds of the second of two rounds (the first warms up), and its deltas."""
        for _rnd in range(2):
            out = {}
            with _Timer(device) as t:
                for batch in batches:
                    for n, d in zip(batch, tk.diff_many_cuda([(old[n], new[n]) for n in batch], warps=warps), strict=True):
                        out[n] = d
        return t.seconds, out

    t_diff, deltas = triton_diff(tk.DIFF_WARPS)
    rows.append(Row(f"diff, Triton (staged, {tk.DIFF_WARPS} warps)", t_diff, f"{len(batches)} host syncs"))
    changed = sum(d.changed for d in deltas.values())

    def torch_diff() -> tuple[float, dict]:
        """The baseline's seconds (second of two rounds) and its (positions, new bits) per tensor."""
        for _rnd in range(2):
            out = {}
            with _Timer(device) as t:
                for n in names:
                    a, b = bits_view(old[n]), bits_view(new[n])
                    idx = torch.ne(a, b).nonzero().squeeze(1)
                    out[n] = (idx, b[idx])
        return t.seconds, out

    t_ref, ref = torch_diff()
    rows.append(Row("diff, torch ne+nonzero (baseline)", t_ref, f"{len(names)} host syncs"))

    diff_ok = _same_as_torch(deltas, ref)
    # the same diff at other warps per program: the register report (triton_compile) predicts, this measures
    for warps in [w for w in sweep if w != tk.DIFF_WARPS]:
        t_sweep, swept = triton_diff(warps)
        rows.append(Row(f"diff, Triton (staged, {warps} warps)", t_sweep, "sweep"))
        diff_ok &= _same_as_torch(swept, ref)
        del swept

    # apply kernels on device, from device-resident (position, bits) arrays
    target = {n: t.clone() for n, t in old.items()}
    diffs = {n: (d.new_bits.to(torch.int32) - d.old_bits.to(torch.int32)).to(torch.int16) for n, d in deltas.items()}
    saved = {n: torch.empty_like(d.old_bits) for n, d in deltas.items()}
    for rnd in range(2):
        if rnd:
            for n in names:
                tk.scatter_cuda_(bits_view(target[n]), deltas[n].positions, deltas[n].old_bits)  # back to old, untimed
        with _Timer(device) as t_apply:
            for n in names:
                tk.apply_diff_cuda_(bits_view(target[n]), deltas[n].positions, diffs[n], saved[n])
    rows.append(Row("apply, Triton (in place, +diff)", t_apply.seconds))
    apply_ok = all(torch.equal(bits_view(target[n]), bits_view(new[n])) for n in names)
    del target, diffs, saved

    target = {n: t.clone() for n, t in old.items()}
    for rnd in range(2):
        if rnd:
            for n in names:
                target[n].copy_(old[n])
        with _Timer(device) as t_ref_apply:
            for n in names:
                bits_view(target[n]).index_copy_(0, ref[n][0], ref[n][1])
    rows.append(Row("apply, torch index_copy_ (baseline)", t_ref_apply.seconds))
    ref_ok = all(torch.equal(bits_view(target[n]), bits_view(new[n])) for n in names)
    del target, ref

    codec_ok = device_ok = scan_ok = True
    patch_bytes = 0
    huffman_kernel = None
    huffman_line = scan_line = ""
    scan_kernels: tuple = ()
    if not args.skip_codec:
        t1 = time.perf_counter()
        patch = encode_deltas(((n, deltas[n]) for n in names), base_version=1, target_version=2,
                              target_root="xxh3-128:" + "0" * 32)
        rows.append(Row("encode (D2H + CPU entropy coder)", time.perf_counter() - t1, f"{len(patch.data) / 1e6:.1f} MB patch"))
        patch_bytes = len(patch.data)
        del deltas
        row, device_ok, huffman_kernel, huffman_line = huffman_device_rows(patch.data, old, new, device,
                                                                           args.cpu_check_gb * 1e9)
        rows.append(row)
        row, scan_ok, scan_kernels, scan_line = huffman_scan_device_rows(old, new, device, args.cpu_check_gb * 1e9)
        rows.append(row)
        was = os.environ.get(DEVICE_DECODE_ENV)
        for device_decode, how in (("0", "CPU decode, H2D, Triton scatter"), ("1", "huffman decoded on the device")):
            if device.type != "cuda" and device_decode == "1":
                continue  # CPU tensors always take the numba decoder
            os.environ[DEVICE_DECODE_ENV] = device_decode
            target = {n: t.clone() for n, t in old.items()}
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            applied = apply_patch_(target, patch.data)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rows.append(Row(f"apply_patch_ ({how})" if device.type == "cuda" else "apply_patch_ (CPU tensors: numba)",
                            time.perf_counter() - t2))
            codec_ok &= all(torch.equal(bits_view(target[n]), bits_view(new[n])) for n in names)
            applied.revert()
            codec_ok &= all(torch.equal(bits_view(target[n]), bits_view(old[n])) for n in names)
        if was is None:
            del os.environ[DEVICE_DECODE_ENV]
        else:
            os.environ[DEVICE_DECODE_ENV] = was
        del target

    copy_gbps = _gbps(nbytes, t_copy.seconds)
    print(f"update: {changed} of {numel} elements changed ({changed / numel:.3%})"
          + (f"; patch {patch_bytes} bytes = {patch_bytes / max(changed, 1):.3f} B/change" if patch_bytes else ""))
    print()
    print(f"{'step':40s} {'ms':>10s} {'GB/s':>9s} {'% copy':>7s}  note")
    for r in rows:
        g = _gbps(nbytes, r.seconds)
        print(f"{r.name:40s} {r.seconds * 1e3:10.2f} {g:9.1f} {100 * g / copy_gbps:6.0f}%  {r.note}")
    for line in (huffman_line, scan_line):
        if line:
            print(line)
    checks = {"triton diff == torch diff": diff_ok, "triton apply bitwise": apply_ok,
              "torch apply bitwise": ref_ok, "patch round trip + revert bitwise": codec_ok,
              "triton huffman decode+apply == new and CPU decoder": device_ok,
              "triton huffman scan + host finish == CPU encoder": scan_ok}
    print()
    for k, v in checks.items():
        print(f"check {k}: {'OK' if v else 'FAILED'}")
    if device.type == "cuda":
        print()
        print("kernels as this device loaded them:")
        for fn in (tk.diff_stage_kernel, tk.diff_place_kernel, tk.apply_diff_kernel, tk.scatter_kernel, huffman_kernel,
                   *scan_kernels):
            if fn is None:
                continue
            for line in kernel_resources(fn):
                print(f"  {line}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
