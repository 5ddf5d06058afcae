"""The Triton decoder of ``huffman`` streams (``triton_huffman``), run by Triton's interpreter on
CPU tensors, byte for byte against the CPU decoder (``tile_decode``): the same bytes applied,
the same revert, and on a damaged stream the same error codes, the same counts of changes
written, the same ``CorruptData`` and the tensor left bitwise unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import numpy as np
import pytest
import torch

from weftboard.cuda import decode, huffman, tile_encode
from weftboard.cuda.entropy import NSYM, read_varint
from weftboard.cuda.tensor_bits import bits_view, cpu_bits
from weftboard.cuda.tile_decode import apply_tiles
from weftboard.proto.errors import CorruptData

triton_huffman = pytest.importorskip("weftboard.cuda.triton_huffman")

TILE = 256  # the smallest tile the format allows: a few thousand elements make several tiles
NUMEL = 3 * 1024 + 77  # tiles 4..7 get no changes (an empty stretch), the last tile is partial
DTYPES = [torch.bfloat16, torch.float32, torch.int32, torch.uint8, torch.int8]


def _pair(dtype: torch.dtype, seed: int, numel: int = NUMEL, density: float = 0.04) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new): random bits and sparse changes of every kind a stream codes: small steps
    (symbols), sign flips and far jumps (escapes), none in tiles 4..7."""
    rng = np.random.default_rng(seed)
    width = dtype.itemsize
    udt = {1: np.uint8, 2: np.uint16, 4: np.uint32}[width]
    top = 1 << (8 * width)
    old = rng.integers(0, top, numel, dtype=np.uint64).astype(udt)
    pick = rng.random(numel) < density
    pick[4 * TILE:8 * TILE] = False
    pick[-1] = True  # the partial tile's last element
    steps = np.array([1, 2, 5, 64, top - 1, top - 3, top - 64, 65, top - 65, top >> 1, 1000 % top], np.uint64)
    new = old.copy()
    new[pick] = (old[pick].astype(np.uint64) + rng.choice(steps, int(pick.sum()))).astype(udt)
    return _tensor(old, dtype), _tensor(new, dtype)


def _tensor(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(bits.copy())
    if dtype == torch.uint8:
        return t
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]).view(dtype)


def _stream(old: torch.Tensor, new: torch.Tensor, tile: int = TILE) -> tuple[dict, np.ndarray]:
    """A patch entry and its ``huffman`` stream, from the CPU encoder."""
    changed, stream = tile_encode.encode_huffman(cpu_bits(old), cpu_bits(new), tile)
    assert stream is not None
    return {"name": "w", "mode": "huffman", "numel": old.numel(), "changed": changed, "tile": tile}, stream


def _apply(target: torch.Tensor, stream: np.ndarray, entry: dict, sign: int = 1) -> None:
    triton_huffman.apply_huffman_cuda_(target, stream, changed=entry["changed"], tile=entry["tile"], sign=sign,
                                       name=entry["name"])


def _bits(t: torch.Tensor) -> bytes:
    return bits_view(t).numpy().tobytes()


def _cpu_apply(entry: dict, stream: np.ndarray, old: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """The CPU path's result on a copy of ``old``: the tensor after it, and its error message."""
    target = old.clone()
    try:
        decode.apply_tile_stream_(target, entry, decode.parse_tile_stream(entry, stream, old.element_size()), 1)
    except CorruptData as exc:
        return target, str(exc)
    return target, None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_applies_the_cpu_paths_bytes_and_reverts(dtype: torch.dtype) -> None:
    old, new = _pair(dtype, seed=dtype.itemsize)
    entry, stream = _stream(old, new)
    sp = decode.parse_tile_stream(entry, stream, old.element_size())
    assert sp.esc.any() and not sp.ns[4:8].any() and sp.ns[-1] > 0  # escapes, empty tiles, the partial tile
    cpu, msg = _cpu_apply(entry, stream, old)
    assert msg is None
    target = old.clone()
    _apply(target, stream, entry)
    assert _bits(target) == _bits(cpu) == _bits(new)
    _apply(target, stream, entry, sign=-1)
    assert _bits(target) == _bits(old)


def test_a_one_symbol_table_has_no_value_bits_and_still_applies() -> None:
    """Every change +1: the code's one symbol has length 0 and every tile's value bytes are none."""
    old = _tensor(np.random.default_rng(5).integers(0, 1 << 16, NUMEL, dtype=np.uint64).astype(np.uint16),
                  torch.bfloat16)
    bits = cpu_bits(old).copy()
    bits[::7] += 1
    new = _tensor(bits, torch.bfloat16)
    entry, stream = _stream(old, new)
    sp = decode.parse_tile_stream(entry, stream, 2)
    assert not sp.rans.any() and np.all(sp.slot2sym == 0)
    target = old.clone()
    _apply(target, stream, entry)
    assert _bits(target) == _bits(new)


def test_a_stream_of_one_tile_of_the_codecs_size_applies() -> None:
    """The tile the encoder writes (CODEC_TILE) is larger than the tensor: one partial tile."""
    old, new = _pair(torch.bfloat16, seed=11, numel=2000, density=0.02)
    entry, stream = _stream(old, new, tile=65536)
    target = old.clone()
    _apply(target, stream, entry)
    assert _bits(target) == _bits(new)


def _value_and_rice_spans(entry: dict, stream: np.ndarray, width: int) -> tuple[list[int], list[int]]:
    sp = decode.parse_tile_stream(entry, stream, width)
    rice = [int(b) for t in np.flatnonzero(sp.ns) for b in range(sp.offs[t], sp.offs[t] + sp.rice[t])]
    value = [int(b) for t in np.flatnonzero(sp.rans) for b in range(sp.offs[t] + sp.rice[t],
                                                                     sp.offs[t] + sp.rice[t] + sp.rans[t])]
    return rice, value


def _damaged(stream: np.ndarray, at: int, xor: int) -> np.ndarray:
    raw = stream.copy()
    raw[at] ^= xor
    return raw


def _check_damaged(entry: dict, raw: np.ndarray, old: torch.Tensor) -> str | None:
    """The Triton decoder refuses ``raw`` exactly when the CPU path does, with its message, and
    then leaves the tensor bitwise unchanged; a stream both accept gives both the same bytes."""
    cpu, msg = _cpu_apply(entry, raw, old)
    target = old.clone()
    if msg is None:
        _apply(target, raw, entry)
        assert _bits(target) == _bits(cpu)
        return None
    with pytest.raises(CorruptData) as exc:
        _apply(target, raw, entry)
    assert str(exc.value) == msg
    assert _bits(target) == _bits(old) == _bits(cpu)
    return msg


def _refused_damage(entry: dict, stream: np.ndarray, old: torch.Tensor, spans: list[int]) -> np.ndarray:
    """The first byte flip in ``spans`` (from the middle on) that the CPU path refuses."""
    for at in spans[len(spans) // 2:] + spans[:len(spans) // 2]:
        raw = _damaged(stream, at, 0x41)
        if _cpu_apply(entry, raw, old)[1] is not None:
            return raw
    raise AssertionError("no flip in these bytes is refused")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
def test_damage_in_rice_or_value_bits_is_refused_like_the_cpu_path_and_undone(dtype: torch.dtype) -> None:
    """Damage in the middle of the stream: the tiles before the damaged one were written and
    must be taken back. Flips that still decode (the xxh3-64 check is what refuses those) must
    give the CPU path's bytes."""
    old, new = _pair(dtype, seed=20 + dtype.itemsize, numel=5 * TILE + 13, density=0.08)
    entry, stream = _stream(old, new)
    rice, value = _value_and_rice_spans(entry, stream, old.element_size())
    assert _check_damaged(entry, _refused_damage(entry, stream, old, rice), old) is not None
    assert _check_damaged(entry, _refused_damage(entry, stream, old, value), old) is not None
    for at in np.random.default_rng(dtype.itemsize).choice(rice + value, 3):
        _check_damaged(entry, _damaged(stream, int(at), 0xFF), old)


def test_a_rice_parameter_out_of_range_is_refused_before_a_write_of_that_tile() -> None:
    old, new = _pair(torch.bfloat16, seed=3)
    entry, stream = _stream(old, new)
    lengths = np.zeros(NSYM, np.int64)
    present = np.zeros(NSYM, np.bool_)
    err, p, _ = huffman.read_table(stream, 0, stream.size, lengths, present)
    assert err == 0
    n0, p = read_varint(stream, p, stream.size)  # tile 0's change count; its k follows
    assert n0 > 0
    raw = stream.copy()
    raw[p] = 200
    assert "Rice parameter is out of range" in _check_damaged(entry, raw, old)


def test_a_truncated_stream_is_refused_before_any_write() -> None:
    old, new = _pair(torch.float32, seed=8)
    entry, stream = _stream(old, new)
    for cut in (1, stream.size // 2, stream.size - 1):
        target = old.clone()
        with pytest.raises(CorruptData):
            _apply(target, stream[:cut], entry)
        assert _bits(target) == _bits(old)


def test_error_codes_and_counts_written_match_the_cpu_decoder_tile_by_tile() -> None:
    """The kernel's per-tile verdicts and counts, which the undo relies on, are the CPU's."""
    old, new = _pair(torch.int16, seed=31, numel=6 * TILE, density=0.1)
    entry, stream = _stream(old, new)
    rice, value = _value_and_rice_spans(entry, stream, 2)
    for at in (rice[3], value[3], rice[-2], value[-1]):
        raw = _damaged(stream, at, 0x5A)
        sp = decode.parse_tile_stream(entry, raw, 2)
        ref = cpu_bits(old).copy()
        errs, done = apply_tiles(sp.buf, ref, sp.numel, sp.tile, sp.width, sp.ns, sp.ks, sp.rice, sp.rans, sp.esc,
                                 sp.offs, sp.freq, sp.cum, sp.slot2sym, 1, sp.ns)
        target = old.clone()
        dev = triton_huffman.DeviceTiles(sp, target.device)
        got_errs, got_done = dev.launch(bits_view(target), 1, dev.ns)
        assert got_errs.tolist() == errs.tolist() and got_done.tolist() == done.tolist()
        assert bits_view(target).numpy().view(np.uint16).tobytes() == ref.tobytes()


def test_the_kernel_refuses_a_sparse_stream() -> None:
    sp = decode.TileStream(np.zeros(1, np.uint8), 1, 256, 2, *(np.zeros(1, np.int64),) * 5, np.zeros(1, np.int64),
                           np.zeros(1, np.int64), np.zeros(1, np.uint8), np.zeros(1, np.uint16))
    with pytest.raises(ValueError, match="huffman"):
        triton_huffman.DeviceTiles(sp, torch.device("cpu"))


_COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from weftboard.cuda import triton_huffman as th
from weftboard.cuda.bench.triton_compile import cubin_resources
for arch in (80, 90):
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    for elem, width in (("u8", 1), ("i16", 2), ("i32", 4), ("i64", 8)):
        for sign in (1, -1):
            sig = {"t_ptr": "*" + elem, "buf_ptr": "*u8", "meta_ptr": "*i64", "table_ptr": "*i32", "limit_ptr": "*i64",
                   "out_ptr": "*i64", "n_tiles": "i32", "tile": "i32", "SIGN": "constexpr", "WIDTH": "constexpr"}
            src = ASTSource(fn=th.huffman_apply_kernel, signature=sig, constexprs={"SIGN": sign, "WIDTH": width})
            compiled = triton.compile(src, target=target, options=backend.parse_options({"num_warps": th.WARPS}).__dict__)
            print(json.dumps({"arch": arch, "elem": elem, "sign": sign, **cubin_resources(compiled.asm["cubin"])}))
"""


def test_the_kernel_compiles_for_a100_and_h100_without_spills() -> None:
    """The interpreter accepts what a GPU backend may not (scalar loops, 64-bit shifts): the
    kernel lowers to cubins for sm_80 and sm_90 at every element width and sign, with no GPU
    (``bench.triton_compile``'s way), in a process without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 16
    assert all(0 < r["REG"] <= 255 and r["STACK"] == 0 and r["LOCAL"] == 0 for r in rows), rows
