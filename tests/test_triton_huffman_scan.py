"""The Triton scan of the ``huffman`` encoder (``triton_huffman_scan``), run by Triton's
interpreter on CPU tensors, byte for byte against the CPU encoder (``tile_encode.encode_huffman``):
the same stream (or the same None) and change count, and the stream applies back to ``new``
through the CPU decoder and the Triton one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import numpy as np
import pytest
import torch
from test_triton_huffman import DTYPES, NUMEL, TILE, _bits, _cpu_apply, _pair, _tensor

from weftboard.cuda import tile_encode
from weftboard.cuda.tensor_bits import bits_view, cpu_bits

scan = pytest.importorskip("weftboard.cuda.triton_huffman_scan")
triton_huffman = pytest.importorskip("weftboard.cuda.triton_huffman")

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _same_as_cpu(old: torch.Tensor, new: torch.Tensor, tile: int = TILE) -> tuple[int, np.ndarray | None]:
    """The device scan's (changes, stream), asserted equal to the CPU encoder's."""
    changed, stream = scan.encode_huffman_cuda(old, new, tile)
    ref_changed, ref = tile_encode.encode_huffman(cpu_bits(old), cpu_bits(new), tile)
    assert changed == ref_changed
    assert (stream is None) == (ref is None)
    if ref is not None:
        assert stream.tobytes() == ref.tobytes()
    return changed, stream


def _round_trip(old: torch.Tensor, new: torch.Tensor, stream: np.ndarray, changed: int, tile: int = TILE) -> None:
    """The stream applied to ``old`` by the CPU decoder and by the Triton decoder gives ``new``."""
    entry = {"name": "w", "mode": "huffman", "numel": old.numel(), "changed": changed, "tile": tile}
    cpu, err = _cpu_apply(entry, stream, old)
    assert err is None and _bits(cpu) == _bits(new)
    target = old.clone()
    triton_huffman.apply_huffman_cuda_(target, stream, changed=changed, tile=tile)
    assert _bits(target) == _bits(new)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_stream_is_the_cpu_encoders_and_applies_back(dtype: torch.dtype) -> None:
    """Sparse changes with escapes, tiles 4..7 empty, a partial last tile."""
    old, new = _pair(dtype, 11)
    changed, stream = _same_as_cpu(old, new)
    assert stream is not None and changed > 0
    _round_trip(old, new, stream, changed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32, torch.uint8], ids=str)
def test_a_dense_tile_and_a_long_gap_give_the_cpu_encoders_bytes(dtype: torch.dtype) -> None:
    """Tile 0 changed everywhere (small steps), tile 1 changed in a cluster and then once at its
    end: a gap whose unary part takes the writer's 32-one-bit steps; nothing else changed."""
    rng = np.random.default_rng(5)
    width = dtype.itemsize
    udt = _UNSIGNED[width]
    top = 1 << (8 * width)
    old = rng.integers(0, top, 4 * TILE + 100, dtype=np.uint64).astype(udt)
    new = old.copy()
    steps = rng.choice(np.array([1, 3, top - 2, 64], np.uint64), TILE)
    new[:TILE] = (old[:TILE].astype(np.uint64) + steps).astype(udt)
    new[TILE:TILE + 100] = (old[TILE:TILE + 100].astype(np.uint64) + 1).astype(udt)
    new[2 * TILE - 1] = old[2 * TILE - 1] ^ udt(top >> 1)  # a sign flip: an escape
    o, n = _tensor(old, dtype), _tensor(new, dtype)
    changed, stream = _same_as_cpu(o, n)
    assert changed == TILE + 101
    _round_trip(o, n, stream, changed)


def test_one_symbol_in_all_gives_the_cpu_encoders_table_of_one() -> None:
    old, new = _pair(torch.bfloat16, 2)
    a = bits_view(old).numpy().view(np.uint16)
    b = bits_view(new).numpy().view(np.uint16)
    b[:] = np.where(a != b, a + np.uint16(1), a)  # every change is +1: symbol 0, no value bits
    changed, stream = _same_as_cpu(old, new)
    _round_trip(old, new, stream, changed)


def test_no_change_gives_no_stream_as_on_cpu() -> None:
    old, _ = _pair(torch.bfloat16, 3)
    assert _same_as_cpu(old, old.clone()) == (0, None)
    assert scan.encode_huffman_cuda(old[:0], old[:0], TILE) == (0, None)


@pytest.mark.parametrize(("dtype", "numel"), [(torch.int32, NUMEL), (torch.int16, 2 * TILE + 1)], ids=str)
def test_a_tile_of_escapes_past_its_scratch_gives_none_like_the_cpu_scan(dtype: torch.dtype, numel: int) -> None:
    """A tile whose escapes outgrow the CPU scan's scratch: both give the count and no stream."""
    rng = np.random.default_rng(7)
    udt = _UNSIGNED[dtype.itemsize]
    old = rng.integers(0, 1 << 15, numel, dtype=np.uint64).astype(udt)
    new = old.copy()
    new[TILE:2 * TILE] ^= udt(0x4000)  # far jumps in every element of tile 1
    new[3] += udt(1)
    changed, stream = _same_as_cpu(_tensor(old, dtype), _tensor(new, dtype))
    assert changed == TILE + 1 and stream is None


@pytest.mark.parametrize(("dtype", "density"), [(torch.int32, 0.002), (torch.bfloat16, 0.3), (torch.uint8, 0.9)],
                         ids=str)
def test_every_density_gives_the_cpu_encoders_rice_parameters_and_bytes(dtype: torch.dtype, density: float) -> None:
    """Very sparse tiles (a large Rice parameter) to nearly dense ones (k = 0), tiles of 1024."""
    old, new = _pair(dtype, 9, numel=4 * 1024 + 77, density=density)
    changed, stream = _same_as_cpu(old, new, tile=1024)
    _round_trip(old, new, stream, changed, tile=1024)


def test_a_tensor_shorter_than_a_tile_gives_the_cpu_encoders_bytes() -> None:
    old, new = _pair(torch.bfloat16, 6, numel=37, density=0.2)
    changed, stream = _same_as_cpu(old, new)
    _round_trip(old, new, stream, changed)


def test_a_larger_tile_scans_in_blocks_of_1024() -> None:
    """Tile 3 holds one change, at its end: a gap of 2047 (Rice parameter 10)."""
    old, new = _pair(torch.float32, 4, numel=4 * 2048 + 5, density=0.01)
    b = bits_view(new)
    b[3 * 2048:] = bits_view(old)[3 * 2048:]
    b[4 * 2048 - 1] += 1
    changed, stream = _same_as_cpu(old, new, tile=2048)
    _round_trip(old, new, stream, changed, tile=2048)


def test_arguments_the_scan_does_not_take_are_refused() -> None:
    old, new = _pair(torch.bfloat16, 1)
    with pytest.raises(ValueError, match="multiple of 64"):
        scan.encode_huffman_cuda(old, new, 100)
    with pytest.raises(ValueError, match="4-byte"):
        scan.encode_huffman_cuda(old.double(), new.double(), TILE)
    with pytest.raises(ValueError, match="one dtype"):
        scan.encode_huffman_cuda(old, new.float(), TILE)


_COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from weftboard.cuda import triton_huffman_scan as ts
from weftboard.cuda.bench.triton_compile import cubin_resources
for arch in (80, 90):
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    for elem, width in (("u8", 1), ("i16", 2), ("i32", 4)):
        e = "*" + elem
        kernels = (
            (ts.huffman_count_kernel, {"o_ptr": e, "n_ptr": e, "out_ptr": "*i64", "numel": "i32", "tile": "i32",
                                       "n_tiles": "i32", "WIDTH": "constexpr", "BLOCK": "constexpr"}, ts.SCAN_WARPS),
            (ts.huffman_place_kernel, {"o_ptr": e, "n_ptr": e, "meta_ptr": "*i64", "buf_ptr": "*u8", "pos_ptr": "*i32",
                                       "numel": "i32", "tile": "i32", "WIDTH": "constexpr", "BLOCK": "constexpr"},
             ts.SCAN_WARPS),
        )
        for fn, sig, warps in kernels:
            src = ASTSource(fn=fn, signature=sig, constexprs={"WIDTH": width, "BLOCK": 1024})
            options = backend.parse_options({"num_warps": warps}).__dict__
            compiled = triton.compile(src, target=target, options=options)
            print(json.dumps({"arch": arch, "kernel": fn.__name__, "elem": elem, **cubin_resources(compiled.asm["cubin"])}))
    sig = {"pos_ptr": "*i32", "meta_ptr": "*i64", "buf_ptr": "*u8", "len_ptr": "*i32"}
    src = ASTSource(fn=ts.huffman_rice_kernel, signature=sig, constexprs={})
    compiled = triton.compile(src, target=target, options=backend.parse_options({"num_warps": ts.RICE_WARPS}).__dict__)
    print(json.dumps({"arch": arch, "kernel": "huffman_rice_kernel", "elem": "-",
                      **cubin_resources(compiled.asm["cubin"])}))
"""


def test_the_kernels_compile_for_a100_and_h100_without_spills() -> None:
    """The interpreter accepts what a GPU backend may not (scalar loops, 64-bit shifts, scans
    of int64): the three kernels lower to cubins for sm_80 and sm_90 at every element width,
    with no GPU (``bench.triton_compile``'s way), in a process without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 2 * (3 * 2 + 1)
    assert all(0 < r["REG"] <= 255 and r["STACK"] == 0 and r["LOCAL"] == 0 for r in rows), rows
