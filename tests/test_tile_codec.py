"""The fused CPU kernels (``weftboard.cuda.tile_*``) against the two-step codec.

Both directions are cross-checked: a fused stream decodes with the two-step decoder to exactly
the diff of the pair, and a two-step stream applies with the fused kernel to exactly the new
bits. A stream that hashes right but was written wrong is found during the fused apply and
every write is undone.
"""

from __future__ import annotations

import dataclasses
import platform
import threading
import warnings

import numba
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from patchkit import load_patch_fixture
from test_jit import _parallel_regions

from weftboard.cuda import (
    codec,
    container,
    decode,
    encode,
    scratch,
    tensor_bits,
    tile_assembly,
    tile_blocks,
    tile_decode,
    tile_encode,
    tile_scan,
)
from weftboard.cuda.bitops import sym_compress64, sym_lanes64
from weftboard.cuda.codec import (
    CODEC_TILE,
    apply_patch_,
    decode_stream,
    encode_deltas,
    encode_patch,
)
from weftboard.cuda.diff import bits_view, diff_tensor
from weftboard.proto.errors import CorruptData, InvalidArgument

ROOT = "xxh3-128:" + "00" * 16
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
DTYPE_OF_WIDTH = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _pair(width: int, n: int, density: float, seed: int, far: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, n * width, dtype=np.uint8).view(UNSIGNED[width])
    b = a.copy()
    mask = rng.random(n) < density
    step = rng.choice(np.array([1, 2, 3, 5, 64, 65, 1000], np.int64), n, p=[0.5, 0.2, 0.1, 0.05, 0.05, 0.05, 0.05])
    step[rng.random(n) < far] = 1 << (8 * width - 2)  # far jumps: escapes
    sign = np.where(rng.random(n) < 0.5, -1, 1)
    with np.errstate(over="ignore"):
        b[mask] = a[mask] + (step[mask] * sign[mask]).astype(np.int64).astype(UNSIGNED[width])
    return a, b


def _entry(width: int, numel: int, changed: int, mode: str = "huffman") -> dict:
    return {"name": "x", "dtype": {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32", 8: "float64"}[width],
            "numel": numel, "changed": changed, "mode": mode, "tile": CODEC_TILE}


def _fused_apply(stream: np.ndarray, target: np.ndarray, changed: int, sign: int = 1, mode: str = "huffman") -> None:
    entry = _entry(target.itemsize, target.size, changed, mode)
    sp = decode.parse_tile_stream(entry, stream, target.itemsize)
    t = torch.from_numpy(target.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[target.itemsize]))
    decode.apply_tile_stream_(t, entry, sp, sign)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n, density", [(1, 1.0), (63, 0.3), (64, 0.02), (65, 0.5), (70_001, 0.001), (200_003, 0.1), (140_000, 0.9)])
def test_fused_stream_decodes_to_the_exact_diff_and_applies_back(width: int, n: int, density: float) -> None:
    """The ``huffman`` stream; the format 1 ``sparse`` streams are read from committed
    fixtures (``test_v1_patches``)."""
    a, b = _pair(width, n, density, seed=n + width)
    changed, stream = tile_encode.encode_huffman(a, b, CODEC_TILE)
    pos = np.flatnonzero(a != b)
    assert changed == pos.size
    if changed == 0:
        assert stream is None
        return
    assert stream is not None
    dec = decode_stream(_entry(width, n, changed), memoryview(stream.tobytes()))
    assert np.array_equal(dec.positions, pos)
    mask = np.uint64((1 << (8 * width)) - 1) if width < 8 else np.uint64(2**64 - 1)
    with np.errstate(over="ignore"):
        want = (b[pos].astype(np.uint64) - a[pos].astype(np.uint64)) & mask
    assert np.array_equal(dec.values.astype(np.uint64), want)
    target = a.copy()
    _fused_apply(stream, target, changed)
    assert np.array_equal(target, b)
    _fused_apply(stream, target, changed, sign=-1)
    assert np.array_equal(target, a)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_two_step_stream_applies_with_the_fused_kernel(width: int) -> None:
    a, b = _pair(width, 150_000, 0.05, seed=3)
    pos = np.flatnonzero(a != b)
    stream = encode._encode_huffman(pos.astype(np.int64), a[pos], b[pos], a.size, CODEC_TILE)
    target = a.copy()
    _fused_apply(stream, target, pos.size)
    assert np.array_equal(target, b)
    if width < 8:  # the fused encoder (the walking scan at 8 bytes has its own test) gives the same bytes
        assert np.array_equal(stream, tile_encode.encode_huffman(a, b, CODEC_TILE)[1])


def test_misaligned_views_give_the_same_stream() -> None:
    a, b = _pair(2, 10_001, 0.2, seed=9)
    a1, b1 = a[1:], b[1:]  # 2-byte offset: the block compares load unaligned
    assert a1.ctypes.data % 8
    changed, stream = tile_encode.encode_huffman(a1, b1, CODEC_TILE)
    aligned_changed, aligned_stream = tile_encode.encode_huffman(a1.copy(), b1.copy(), CODEC_TILE)
    assert changed == aligned_changed and np.array_equal(stream, aligned_stream)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_block_masks_match_an_element_by_element_compare(width: int) -> None:
    a, b = _pair(width, 64 * 40 + 17, 0.3, seed=width)
    b[::97] = a[::97] ^ UNSIGNED[width](1 << (8 * width - 1))  # the top bit alone differs
    for offset in (0, 1, 3):  # aligned and unaligned starts
        x, y = a[offset:], b[offset:]
        got = _block_masks(x, y)
        want = [sum(1 << j for j in range(64) if s + j < x.size and x[s + j] != y[s + j]) for s in range(0, x.size, 64)]
        assert [int(m) for m in got] == want


@numba.njit(cache=False)
def _block_masks(a, b):
    out = np.empty((a.size + 63) // 64, np.uint64)
    for i in range(out.size):
        out[i] = tile_blocks.block_mask(a, b, 64 * i, a.size)
    return out


def test_strided_views_are_refused() -> None:
    a, b = _pair(2, 1000, 0.1, seed=4)
    with pytest.raises(ValueError, match="C-contiguous"):
        tile_encode.encode_huffman(a[::2], b[::2], CODEC_TILE)


def test_thread_count_does_not_change_the_bytes() -> None:
    import numba

    a, b = _pair(2, 600_000, 0.05, seed=11)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = tile_encode.encode_huffman(a, b, CODEC_TILE)[1]
        numba.set_num_threads(before)
        many = tile_encode.encode_huffman(a, b, CODEC_TILE)[1]
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one, many)


def test_a_tile_that_overflows_its_scratch_falls_back_to_the_two_step_encoder() -> None:
    # 2-byte elements that nearly all jump far: more escape bytes than a tile's scratch holds.
    rng = np.random.default_rng(5)
    n = 3 * CODEC_TILE
    a = rng.integers(0, 2**16, n, dtype=np.uint16)
    b = a ^ np.uint16(0x4000)
    b[::1000] = a[::1000]  # not every element changed: the "all" mode does not apply
    changed, stream = tile_encode.encode_huffman(a, b, CODEC_TILE)
    assert changed == int((a != b).sum()) and stream is None
    old = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    new = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
    patch = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT)
    assert patch.data == encode_deltas([("w", diff_tensor(old, new))], base_version=1, target_version=2, target_root=ROOT).data
    target = {"w": old.clone()}
    apply_patch_(target, patch.data)
    assert torch.equal(bits_view(target["w"]), bits_view(new))


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("pieces", [[3 * CODEC_TILE + 5], [CODEC_TILE, 2 * CODEC_TILE + 5], [CODEC_TILE] * 3 + [5]])
def test_scanning_piece_by_piece_gives_the_whole_tensor_stream(width: int, pieces: list[int]) -> None:
    """How the publisher encodes a tensor it folds into its view chunk by chunk."""
    a, b = _pair(width, sum(pieces), 0.05, seed=width)
    b[CODEC_TILE : 2 * CODEC_TILE] = a[CODEC_TILE : 2 * CODEC_TILE]  # a tile run with no change at all
    whole_changed, whole = tile_encode.encode_huffman(a, b, CODEC_TILE)
    scratch: dict = {}
    scans, start = [], 0
    for size in pieces:
        scan = tile_encode.scan_tiles(a[start : start + size], b[start : start + size], CODEC_TILE, scratch)
        assert scan is not None
        scans.append(scan)
        start += size
    assert sum(s.changed for s in scans) == whole_changed and scratch
    assert np.array_equal(tile_encode.finish_huffman(scans, width), whole)


def test_an_overflowing_tile_is_neither_scanned_nor_folded() -> None:
    a, b = _pair(2, 3 * CODEC_TILE, 0.05, seed=6)
    b[CODEC_TILE : 2 * CODEC_TILE] = a[CODEC_TILE : 2 * CODEC_TILE] ^ np.uint16(0x4000)  # tile 1: all escapes
    before = a.copy()
    scan = tile_encode.scan_tiles(a, b, CODEC_TILE, update=True)
    assert scan.overflowed.tolist() == [1] and scan.ns[1] == 0
    assert np.array_equal(a[CODEC_TILE : 2 * CODEC_TILE], before[CODEC_TILE : 2 * CODEC_TILE])  # left alone
    assert np.array_equal(a[:CODEC_TILE], b[:CODEC_TILE]) and np.array_equal(a[2 * CODEC_TILE :], b[2 * CODEC_TILE :])
    assert scan.changed == int((before != b).sum()) - CODEC_TILE and scan.counts.sum() == scan.changed
    with pytest.raises(ValueError, match="overflowed"):
        tile_encode.finish_huffman([scan], 2)
    with pytest.raises(ValueError, match="at least one change"):
        tile_encode.finish_huffman([tile_encode.scan_tiles(a, a, CODEC_TILE)], 2)


@pytest.mark.parametrize("width, density", [(2, 0.02), (2, 0.6), (1, 0.3), (4, 0.05)])
def test_scanning_with_update_folds_new_into_old_and_keeps_the_stream(width: int, density: float) -> None:
    """Dense tiles take the fold-after-walk path, sparse ones fold while walking: same result."""
    a, b = _pair(width, 2 * CODEC_TILE + 17, density, seed=int(density * 100) + width)
    plain = tile_encode.scan_tiles(a, b, CODEC_TILE)
    folded = a.copy()
    scan = tile_encode.scan_tiles(folded, b, CODEC_TILE, update=True)
    assert not scan.overflowed.size and np.array_equal(folded, b)
    assert np.array_equal(tile_encode.finish_huffman([scan], width), tile_encode.finish_huffman([plain], width))


def test_scanned_tensor_encodes_and_recovers_its_delta() -> None:
    """The publisher's two uses of scans: a finished stream, or (mode not huffman) the delta."""
    g = torch.Generator().manual_seed(11)
    old = (torch.randn(2 * CODEC_TILE + 77, generator=g) * 0.02).bfloat16()
    new = (old.float() + torch.randn(old.shape, generator=g) * 2e-5).bfloat16()
    a, b = (bits_view(t).numpy().view(np.uint16) for t in (old, new))
    scans = [tile_encode.scan_tiles(a[:CODEC_TILE], b[:CODEC_TILE], CODEC_TILE),
             tile_encode.scan_tiles(a[CODEC_TILE:], b[CODEC_TILE:], CODEC_TILE)]
    enc = codec.encoded_from_scans("w", torch.bfloat16, old.numel(), scans)
    ref = diff_tensor(old, new)
    assert enc is not None and enc.mode == "huffman" and enc.changed == ref.changed
    assert np.array_equal(enc.stream, tile_encode.encode_huffman(a, b, CODEC_TILE)[1])
    for delta in (codec.delta_from_encoded(enc, new), codec.delta_from_scans(scans, new)):
        assert torch.equal(delta.positions, ref.positions)
        assert torch.equal(delta.old_bits, ref.old_bits) and torch.equal(delta.new_bits, ref.new_bits)
    # Every element changed: no stream from scans, but the delta is still exact.
    e = a ^ np.uint16(1)  # the last bit of every element flips
    everything = torch.from_numpy(e.view(np.int16)).view(torch.bfloat16)
    all_scans = [tile_encode.scan_tiles(a, e, CODEC_TILE)]
    assert codec.encoded_from_scans("w", torch.bfloat16, old.numel(), all_scans) is None
    assert torch.equal(codec.delta_from_scans(all_scans, everything).old_bits, bits_view(old))
    unchanged = codec.encoded_from_scans("w", torch.bfloat16, old.numel(), [tile_encode.scan_tiles(a, a, CODEC_TILE)])
    assert unchanged is not None and unchanged.mode == "empty"
    assert codec.delta_from_encoded(unchanged, old).changed == 0
    with pytest.raises(InvalidArgument, match="does not fit"):
        codec.delta_from_encoded(enc, new[:-1])


def _rice_bits(k: int, mean: float, terms: int = 4000) -> float:
    """Expected Rice(k) length of a geometric gap with the given mean."""
    theta = mean / (mean + 1)
    return k + 1 + sum(theta ** (j << k) for j in range(1, terms))


@pytest.mark.parametrize("mean", [0.0, 0.3, 1.0, 2.5, 9.0, 30.0, 99.0, 700.0, 5000.0])
def test_rice_parameter_is_the_optimum_for_geometric_gaps(mean: float) -> None:
    n = 1000
    k = tile_blocks.rice_k(int(mean * n), n)
    costs = {j: _rice_bits(j, mean) for j in range(0, 16)}
    assert costs[k] <= min(costs.values()) + 1e-9


def test_realistic_bf16_update_matches_the_two_step_encoder_in_size() -> None:
    from weftboard.cuda import formats

    master = {"w": torch.randn(512, 1536) * 0.02}
    stepped = {"w": master["w"] + 3e-6 * torch.sign(torch.randn(512, 1536))}
    proj = formats.Projector(formats.ServedFormatSpec("bf16"))
    old, new = proj.project(master, anchor=True)["w"], proj.project(stepped, anchor=False)["w"]
    fused = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT)
    two_step = encode_deltas([("w", diff_tensor(old, new))], base_version=1, target_version=2, target_root=ROOT)
    assert codec.read_patch_info(fused.data).tensors[0].mode == "huffman"
    assert len(fused.data) <= len(two_step.data) * 1.002
    # The compact encoding writes the context stream for this pair (format 3), smaller still.
    compact = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT, encoding="compact")
    assert codec.read_patch_info(compact.data).tensors[0].mode == "context_huffman"
    assert len(compact.data) < len(fused.data)


def _written_wrong_but_hashing_right(patch_data: bytes, name: str, flip_at: float) -> bytes:
    """The container rebuilt with one stream damaged and its checksum recomputed."""
    c = container.read_container(patch_data)
    entries = [dict(e) for e in c.entries]
    streams = []
    for e in entries:
        if e["mode"] == "empty":
            continue
        raw = bytearray(c.streams[e["name"]])
        if e["name"] == name:
            i = int(len(raw) * flip_at)
            raw[i] ^= 0xFF
            e["xxh3_64"] = xxhash.xxh3_64_hexdigest(bytes(raw))
        streams.append((e["name"], bytes(raw)))
    header = dict(c.header, tensors=entries)
    return container.write_container(header, streams)


def test_a_stream_written_wrong_is_undone_during_the_fused_apply() -> None:
    """Damage the entropy decoder finds mid-apply (some flips parse to other valid positions
    or values, which only the root digest can catch: a prefix code falls back into step after
    a flipped byte more often than not): every write of the call is undone."""
    olds, news = {}, {}
    for i, name in enumerate(["a", "b", "c"]):
        a, b = _pair(2, 300_000, 0.05, seed=20 + i, far=0.0)
        olds[name] = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        news[name] = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
    patch = encode_patch([(n, olds[n], news[n]) for n in olds], base_version=1, target_version=2, target_root=ROOT)
    refused = 0
    for flip_at in np.linspace(0.05, 0.99, 25):
        bad = _written_wrong_but_hashing_right(patch.data, "b", float(flip_at))
        target = {n: t.clone() for n, t in olds.items()}
        try:
            apply_patch_(target, bad)
        except CorruptData as exc:
            assert "'b'" in str(exc)
            refused += 1
            for n in olds:  # "a" was applied in full and "b" in part before the damage was found
                assert torch.equal(bits_view(target[n]), bits_view(olds[n])), (n, flip_at)
        else:
            assert not torch.equal(bits_view(target["b"]), bits_view(news["b"]))  # wrong, and the digest says so
    assert refused >= 10


def test_directory_damage_is_refused_before_any_write() -> None:
    a, b = _pair(2, 200_000, 0.05, seed=30)
    old = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    new = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
    patch = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT)
    bad = _written_wrong_but_hashing_right(patch.data, "w", 0.0)  # the first byte: the table size
    target = {"w": old.clone()}
    with pytest.raises(CorruptData):
        apply_patch_(target, bad)
    assert torch.equal(bits_view(target["w"]), bits_view(old))



def _fp32_pair(n: int, density: float, seed: int, special_at: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(bf16 bits of an old view, fp32 bits of new master weights), a ``density`` of them
    rounding differently; ``special_at``: elements made NaN or subnormal."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen) * 0.02
    old = master.to(torch.bfloat16)
    moved = master + torch.where(torch.rand(n, generator=gen) < density, 2e-4, 0.0)
    for k, i in enumerate(special_at):
        moved[i] = (float("nan"), -float("nan"), 1e-40, -3e-39, float("inf"))[k % 5]
    return unsigned_np_of(old), moved.view(torch.int32).numpy().view(np.uint32)


def unsigned_np_of(t: torch.Tensor) -> np.ndarray:
    return bits_view(t).numpy().view(UNSIGNED[t.element_size()])


@pytest.mark.parametrize("n", [CODEC_TILE * 3, CODEC_TILE * 2 + 1000, 77])
def test_a_cast_scan_equals_torch_cast_then_scan(n: int) -> None:
    old, src = _fp32_pair(n, 0.05, seed=n)
    want_old = old.copy()
    torch_new = unsigned_np_of(torch.from_numpy(src.view(np.float32)).to(torch.bfloat16))
    want = tile_encode.scan_tiles(want_old, torch_new, CODEC_TILE, update=True)
    got = tile_encode.scan_tiles(old, src, CODEC_TILE, update=True, cast=True)
    assert got.overflowed.size == 0 and got.changed == want.changed > 0
    assert np.array_equal(old, torch_new)  # folded: the view now holds torch's cast
    for field_name in ("ns", "ks", "rice_len", "n_esc", "rice", "syms", "escs", "counts"):
        assert np.array_equal(getattr(got, field_name), getattr(want, field_name)), field_name


def test_a_cast_scan_leaves_tiles_with_nan_or_subnormals_to_the_caller() -> None:
    n = CODEC_TILE * 4
    specials = (5, CODEC_TILE * 2 + 7, CODEC_TILE * 2 + 9, CODEC_TILE * 3 + 100, CODEC_TILE * 3 + 101)
    old, src = _fp32_pair(n, 0.05, seed=3, special_at=specials)
    before = old.copy()
    got = tile_encode.scan_tiles(old, src, CODEC_TILE, update=True, cast=True)
    assert got.overflowed.tolist() == [0, 2, 3]  # tile 3 holds +inf too, which alone is fine
    torch_new = unsigned_np_of(torch.from_numpy(src.view(np.float32)).to(torch.bfloat16))
    assert np.array_equal(old[CODEC_TILE:2 * CODEC_TILE], torch_new[CODEC_TILE:2 * CODEC_TILE])
    for t in (0, 2, 3):  # untouched, counted nowhere
        assert np.array_equal(old[t * CODEC_TILE:(t + 1) * CODEC_TILE], before[t * CODEC_TILE:(t + 1) * CODEC_TILE])
        assert got.ns[t] == 0


def test_the_cast_matches_torch_on_every_finite_and_infinite_input() -> None:
    # all exponents and rounding cases, ties included: random bits, plus the values at and
    # next to each tie (low 16 bits 0x7FFF, 0x8000, 0x8001) and the ones that round to inf
    gen = np.random.default_rng(1)
    bits = gen.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    ties = (bits & np.uint32(0xFFFF0000))[:, None] | np.array([0x7FFF, 0x8000, 0x8001, 0], np.uint32)
    extremes = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x80000000, 0], np.uint32)
    src = np.concatenate([bits, ties.ravel(), extremes])
    mag = src & np.uint32(0x7FFFFFFF)
    src = src[(mag <= 0x7F800000) & ((mag == 0) | (mag >= 0x00800000))]  # no NaN, no subnormal
    want = unsigned_np_of(torch.from_numpy(src.view(np.float32)).to(torch.bfloat16))
    assert np.array_equal(_cast_all(src), want)


@numba.njit(cache=False)
def _cast_all(src):
    out = np.empty(src.size, np.uint16)
    for i in range(src.size):
        out[i] = tile_blocks.bf16_rne(src[i])
    return out


def test_the_vector_cast_in_a_scan_matches_torch_on_all_exponents_and_ties() -> None:
    gen = np.random.default_rng(2)
    bits = gen.integers(0, 2**32, CODEC_TILE, dtype=np.uint64).astype(np.uint32)
    bits[::3] = (bits[::3] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exact ties
    bits[1::3] = (bits[1::3] & np.uint32(0xFFFF0000)) | np.uint32(0x7FFF)
    mag = bits & np.uint32(0x7FFFFFFF)
    keep = (mag <= 0x7F800000) & ((mag == 0) | (mag >= 0x00800000))
    src = np.ascontiguousarray(bits[keep][: (int(keep.sum()) // 64) * 64 + 13])  # whole blocks and a tail
    want = unsigned_np_of(torch.from_numpy(src.view(np.float32)).to(torch.bfloat16))
    view = want.copy()
    moved = gen.random(src.size) < 0.05
    view[moved] += np.uint16(1)
    got = tile_encode.scan_tiles(view, src, CODEC_TILE, update=True, cast=True)
    assert got.overflowed.size == 0
    assert np.array_equal(view, want)  # every element the vector compare called unchanged was
    assert got.changed == int(moved.sum())  # and no element the cast left alone was called changed


def _scan_with(kernel: str, a: np.ndarray, b: np.ndarray, tile: int, update: bool, cast: bool) -> tuple:
    """Every output of one scan kernel (the results, the tile's Rice bytes, symbols and
    escapes, the folded ``a``), on copies of the inputs."""
    a = a.copy()
    ntiles = (a.size + tile - 1) // tile
    rice = np.zeros(ntiles * (tile + tile_blocks.RICE_SLACK), np.uint8)
    syms = np.zeros(ntiles * 2 * tile, np.uint8)
    args = ((a, a[:0], 2, tile, rice, tile + tile_blocks.RICE_SLACK, syms, update, b, True) if cast else
            (a, b, a.itemsize, tile, rice, tile + tile_blocks.RICE_SLACK, syms, update, np.empty(0, np.uint32), False))
    if kernel in ("compress", "lanes"):
        out = tile_scan.scan_encode_tiles_packed(*args[:8], *tile_scan.packed_scan_args(b if cast else None,
                                                                                           kernel == "compress"))
    else:
        out = tile_scan.scan_encode_tiles(*args)
    ns, ks, rice_len, n_esc, counts, over = out
    pieces = []
    for t in range(ntiles):
        if over[t]:
            continue
        r0, s0 = t * (tile + tile_blocks.RICE_SLACK), 2 * t * tile
        pieces.append((rice[r0 : r0 + rice_len[t]].tobytes(), syms[s0 : s0 + ns[t]].tobytes(),
                       syms[s0 + tile : s0 + tile + n_esc[t] * a.itemsize].tobytes()))
    return [x.tolist() for x in out], pieces, a.tobytes()


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("n, density, far", [(0, 0.0, 0.0), (63, 0.5, 0.1), (64 * 40 + 1, 0.05, 0.01), (5000, 0.9, 0.0),
                                             (5000, 1.0, 0.8), (20_011, 0.01, 0.5), (3000, 0.3, 1.0)])
@pytest.mark.parametrize("update", [False, True])
def test_packed_and_walking_scans_give_the_same_bytes(width: int, n: int, density: float, far: float, update: bool) -> None:
    """The packed scan, with compress-stores (where the CPU has them; elsewhere LLVM lowers
    them element by element) or with lane walks (everywhere else), and the one-walk scan are
    one format: the same streams, counts, overflowed tiles and folds, partial blocks and tiles
    with more escapes than their scratch holds included (every element changed, 80% far)."""
    a, b = _pair(width, n, density, seed=n + width, far=far)
    for tile in (64, 1024):
        walked = _scan_with("walk", a, b, tile, update, cast=False)
        for kernel in ("compress", "lanes"):
            packed = _scan_with(kernel, a, b, tile, update, cast=False)
            assert packed == walked, kernel
            assert update or packed[2] == a.tobytes()
    if far >= 0.8 and density == 1.0 and width == 2:
        assert any(packed[0][5]), "expected tiles that overflow their escape scratch"


@pytest.mark.parametrize("update", [False, True])
def test_packed_and_walking_cast_scans_give_the_same_bytes(update: bool) -> None:
    rng = np.random.default_rng(21)
    master = (rng.standard_normal(9000) * 0.02).astype(np.float32)
    master[[5, 4000]] = np.nan
    old = torch.from_numpy(master).bfloat16().view(torch.int16).numpy().view(np.uint16).copy()
    stepped = master + np.where(rng.random(master.size) < 0.5, 3e-5, -3e-5).astype(np.float32)
    stepped[7000] = 1e-40  # a subnormal: its tile is left to torch
    for tile in (64, 1024):
        walked = _scan_with("walk", old, stepped.view(np.uint32), tile, update, cast=True)
        for kernel in ("compress", "lanes"):
            packed = _scan_with(kernel, old, stepped.view(np.uint32), tile, update, cast=True)
            assert packed == walked, kernel
        assert sum(walked[0][5]) == 3  # the tiles of the two NaNs and the subnormal


@numba.njit(cache=False)
def _compress_block(a, b, m, sym, sym_at, pos, pos_at, base, rare, rare_at, lanes):
    packed = sym_compress64(a, 0, b, 0, m, sym, sym_at, pos, pos_at, base, rare, rare_at)
    return packed, sym_lanes64(a, 0, b, 0, m, lanes)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_a_block_compress_packs_the_changed_lanes_and_writes_nothing_past_64(width: int) -> None:
    """``sym_compress64`` packs each output in a register and stores all 64 lanes: the packed
    lanes must be the changed ones in lane order (positions in two 32-lane halves, the second
    after the first's count), and no byte before an output's start or past its 64 lanes may
    move. Masks: none, one lane, each half alone, all, and random ones."""
    rng = np.random.default_rng(width)
    masks = [0, 1, 1 << 63, (1 << 32) - 1, ((1 << 32) - 1) << 32, (1 << 64) - 1]
    masks += [int(x) for x in rng.integers(0, 1 << 63, 40, dtype=np.int64)]
    guard = 24
    for i, m in enumerate(masks):
        a, b = _pair(width, 64, 0.6, seed=100 + i, far=0.2)
        sym_at, pos_at, rare_at, base = (int(x) for x in rng.integers(0, 40, 4))
        sym = np.full(sym_at + 64 + guard, 0xA5, np.uint8)
        pos = np.full(pos_at + 64 + guard, 0xA5A5, np.uint16)
        rare = np.full(rare_at + 64 + guard, 0xA5, np.uint8)
        lanes = np.zeros(64, np.uint8)
        packed, expected = _compress_block(a, b, np.uint64(m), sym, sym_at, pos, pos_at, base, rare, rare_at, lanes)
        assert packed == expected
        changed = np.array([lane for lane in range(64) if m >> lane & 1], np.int64)
        assert sym[sym_at : sym_at + changed.size].tolist() == lanes[changed].tolist()
        assert pos[pos_at : pos_at + changed.size].tolist() == (base + changed).tolist()
        rare_lanes = [lane for lane in changed if lanes[lane] >= 2]
        assert rare[rare_at : rare_at + len(rare_lanes)].tolist() == lanes[rare_lanes].tolist()
        assert packed[2] == sum(1 << int(lane) for lane in rare_lanes)
        for buf, at, fill in ((sym, sym_at, 0xA5), (pos, pos_at, 0xA5A5), (rare, rare_at, 0xA5)):
            assert (buf[:at] == fill).all() and (buf[at + 64 :] == fill).all(), (m, buf.dtype)


def test_the_packed_scan_uses_compress_stores_where_the_cpu_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from weftboard.cuda import bitops, entropy

    assert (bitops._MAX_DELTA, bitops._ESC) == (entropy.MAX_DELTA, entropy.ESC)
    seen = []
    real = tile_encode._encode_tiles_packed
    monkeypatch.setattr(tile_encode, "_encode_tiles_packed", lambda *args: seen.append(args) or real(*args))
    a, b = _pair(2, 5000, 0.1, seed=3)
    changed, stream = tile_encode.encode_huffman(a, b, 1024)
    (args,) = seen
    assert args[7] is False  # no fold: the encoder leaves ``old`` as it is
    assert args[8] is None  # plain new bits, not a cast
    assert (args[10] is None) == bitops.HAS_VECTOR_COMPRESS  # no lane rows: compress-stores
    assert changed == np.count_nonzero(a != b) and stream is not None


@pytest.mark.parametrize("dtype,lines", [(np.uint8, 1), (np.uint16, 2), (np.uint32, 4), (np.uint64, 8)])
def test_prefetch64_asks_for_every_line_of_the_block_and_changes_nothing(dtype, lines: int) -> None:
    from weftboard.cuda.bitops import prefetch64

    @numba.njit
    def sum_with_hints(a, ahead):
        total = 0
        for bs in range(0, a.size, 64):
            prefetch64(a, bs + ahead)  # runs past the end near the last blocks: a hint, not a load
            for i in range(bs, min(bs + 64, a.size)):
                total += a[i]
        return total

    a = np.arange(1000, dtype=dtype)
    for ahead in (0, 512, 1 << 20):
        assert sum_with_hints(a, ahead) == int(a.astype(np.int64).sum())
    ir = sum_with_hints.inspect_llvm(sum_with_hints.signatures[0])
    assert ir.count("call void @llvm.prefetch") == lines
    if platform.machine() in ("x86_64", "AMD64"):
        assert "prefetcht0" in sum_with_hints.inspect_asm(sum_with_hints.signatures[0])
    with pytest.raises(numba.core.errors.TypingError, match="prefetch64 needs"):
        numba.njit(lambda x: prefetch64(x, 0))(np.zeros((2, 64), np.uint16))


def test_copy_bytes_is_a_slice_copy_that_may_overlap_and_refuses_ranges_outside_its_arrays() -> None:
    from weftboard.cuda.bitops import copy_bytes

    @numba.njit
    def copy(dst, d0, src, s0, n):
        copy_bytes(dst, d0, src, s0, n)

    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 300, dtype=np.uint8)
    for d0, s0, n in [(0, 0, 300), (7, 11, 0), (0, 299, 1), (299, 0, 1), (13, 5, 200), (100, 0, 200)]:
        dst = rng.integers(0, 256, 300, dtype=np.uint8)
        want = dst.copy()
        want[d0:d0 + n] = src[s0:s0 + n]
        copy(dst, d0, src, s0, n)
        assert dst.tobytes() == want.tobytes()
    for d0, s0 in [(10, 0), (0, 10)]:  # one array, overlapping ranges in both directions
        buf = np.arange(100, dtype=np.uint8)
        want = buf.copy()
        want[d0:d0 + 80] = buf[s0:s0 + 80].copy()
        copy(buf, d0, buf, s0, 80)
        assert buf.tobytes() == want.tobytes()
    dst = np.zeros(16, np.uint8)
    for d0, s0, n in [(10, 0, 7), (0, 10, 7), (-1, 0, 2), (0, -1, 2), (0, 0, -1), (0, 0, 17)]:
        with pytest.raises(IndexError, match="outside its array"):
            copy(dst, d0, src[:16], s0, n)
    assert not dst.any()  # nothing written by a refused copy
    with pytest.raises(numba.core.errors.TypingError, match="copy_bytes needs"):
        copy(np.zeros(4, np.uint16), 0, np.zeros(4, np.uint16), 0, 2)


def _copies_in_prange(copy):
    def kernel(dst, src, n):
        for t in numba.prange(dst.size // n):
            copy(dst, t * n, src, t * n, n)
    return kernel


def test_a_prange_loop_that_can_raise_compiles_serially_so_parallel_loops_copy_with_move_bytes() -> None:
    """The yardstick for the next test: ``copy_bytes``' bounds check can raise, and numba then
    makes no parallel region of the loop (and warns); ``move_bytes`` cannot, and it does."""
    from weftboard.cuda.bitops import copy_bytes, move_bytes
    from weftboard.cuda.jit import parallel_kernel

    src = np.arange(64, dtype=np.uint8)
    serial = parallel_kernel(_copies_in_prange(copy_bytes), cache=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", numba.core.errors.NumbaPerformanceWarning)
        dst = np.zeros(64, np.uint8)
        serial(dst, src, 8)
    assert any("no transformation for parallel" in str(w.message) for w in caught)
    assert dst.tobytes() == src.tobytes() and _parallel_regions(serial, serial.signatures[0]) == 0
    parallel = parallel_kernel(_copies_in_prange(move_bytes), cache=False)
    dst = np.zeros(64, np.uint8)
    parallel(dst, src, 8)
    assert dst.tobytes() == src.tobytes() and _parallel_regions(parallel, parallel.signatures[0]) == 1


def _scattered_pieces(nclasses: int) -> dict:
    """Five tiles' pieces (the second with no changes) scattered over three buffers, as the
    scan and rANS passes leave them: a tile's rANS stream ends where the next one's room starts."""
    rng = np.random.default_rng(nclasses)
    ns = rng.integers(1, 5, (5, nclasses)).astype(np.int64)
    ns[1] = 0
    slots = 10 * np.arange(5 * nclasses, dtype=np.int64).reshape(5, nclasses)
    rans_off = 12 * np.arange(6, dtype=np.int64)
    return dict(
        ns=ns, rice_len=np.where(ns > 0, rng.integers(0, 4, ns.shape), 0).astype(np.int64),
        n_esc=np.where(ns > 0, rng.integers(0, 3, ns.shape), 0).astype(np.int64), width=2,
        rice_buf=rng.integers(0, 256, 10 * ns.size, dtype=np.uint8), rice_off=slots,
        esc_buf=rng.integers(0, 256, 10 * ns.size, dtype=np.uint8), esc_off=slots + 3,
        rans_buf=rng.integers(0, 256, 60, dtype=np.uint8), rans_start=rans_off[:-1] + 2, rans_off=rans_off,
        sym_off=7 * np.arange(5, dtype=np.int64),
    )


def _assemble_args(p: dict) -> tuple:
    return (np.arange(4, dtype=np.uint8), np.zeros((0, tile_encode.NSYM), np.int64), p["ns"], np.ones_like(p["ns"]),
            p["rice_len"], p["rans_start"], p["rans_off"], p["n_esc"], p["width"], p["rice_buf"], p["rice_off"],
            p["esc_buf"], p["esc_off"], p["rans_buf"])


def _compact_args(p: dict) -> tuple:  # the escapes and the symbols share one scratch, as in a scan
    return (p["ns"].sum(axis=1), p["rice_len"], p["n_esc"], p["width"], p["rice_buf"], p["rice_off"], p["esc_buf"],
            p["sym_off"], p["esc_off"])


def _piece(buf: np.ndarray, start: int, n: int) -> bytes:
    return buf[start:start + n].tobytes()


@pytest.mark.parametrize("nclasses", [1, 3])
def test_the_assembly_and_the_compaction_copy_their_tiles_in_a_parallel_loop(nclasses: int) -> None:
    """Both kernels check their pieces' ranges before the ``prange`` loop, so the loop compiles
    to a parallel region. Compiled afresh here (a kernel from the disk cache carries no
    diagnostics), each writes the cached kernel's bytes, and those are the pieces in order."""
    from weftboard.cuda.jit import parallel_kernel

    p = _scattered_pieces(nclasses)
    ns, rice_len, n_esc, w = p["ns"], p["rice_len"], p["n_esc"], p["width"]
    args = _assemble_args(p)
    stream = tile_assembly.assemble_tiles(*args)
    prefix, _, _, _, _, rans_start, rans_off, _, _, rice_buf, rice_off, esc_buf, esc_off, rans_buf = args
    out = np.zeros(tile_assembly.assembly_bound(prefix, *args[2:3], *args[4:]), np.uint8)
    dest, tot, end = tile_assembly.assembly_head(out, 0, *args)  # the serial part: tables and directory
    with warnings.catch_warnings():
        warnings.simplefilter("error", numba.core.errors.NumbaPerformanceWarning)
        moves = parallel_kernel(tile_assembly.move_pieces.py_func, cache=False)
        moves(out, dest, tot, rice_buf, rice_off, rice_len, rans_buf, rans_start, rans_off[1:] - rans_start, esc_buf,
              esc_off, n_esc * w)
        compact = parallel_kernel(tile_assembly.compact_tiles.py_func, cache=False)
        compacted = compact(*_compact_args(p))
    assert _parallel_regions(moves, moves.signatures[0]) == 1 and _parallel_regions(compact, compact.signatures[0]) == 1
    assert out[:end].tobytes() == stream.tobytes()
    assert [x.tobytes() for x in compacted] == [x.tobytes() for x in tile_assembly.compact_tiles(*_compact_args(p))]

    changed = [t for t in range(5) if ns[t].any()]
    rice = [b"".join(_piece(p["rice_buf"], p["rice_off"][t, c], rice_len[t, c]) for c in range(nclasses)) for t in changed]
    escs = [b"".join(_piece(p["esc_buf"], p["esc_off"][t, c], n_esc[t, c] * w) for c in range(nclasses)) for t in changed]
    rans = [_piece(p["rans_buf"], p["rans_start"][t], p["rans_off"][t + 1] - p["rans_start"][t]) for t in changed]
    assert stream.tobytes().endswith(b"".join(r + a + e for r, a, e in zip(rice, rans, escs)))
    syms = b"".join(_piece(p["esc_buf"], p["sym_off"][t], ns[t].sum()) for t in range(5))
    assert [x.tobytes() for x in compacted] == [b"".join(rice), syms, b"".join(escs)]


@pytest.mark.parametrize("field, shift", [("rice_off", 1000), ("esc_off", 1000), ("rans_start", -100),
                                          ("rice_len", -10)])
def test_the_assembly_and_the_compaction_refuse_a_piece_outside_its_buffer(field: str, shift: int) -> None:
    p = _scattered_pieces(3)
    p[field] = p[field].copy()
    p[field][-1] += shift  # the last tile has changes: its pieces are copied
    with pytest.raises(IndexError, match="assemble_tiles: a tile's piece lies outside its buffer"):
        tile_assembly.assemble_tiles(*_assemble_args(p))
    if field != "rans_start":  # the compaction has no rANS stream
        with pytest.raises(IndexError, match="compact_tiles: a tile's piece lies outside the scratch"):
            tile_assembly.compact_tiles(*_compact_args(p))


@pytest.mark.parametrize("tile", [1024, 65536])
def test_packed_scan_codes_long_gaps_like_the_walk(tile: int) -> None:
    """Clustered changes make the tile's Rice parameter small, so a lone far change has a
    unary part of hundreds of bits: the packed scan's pairs fall back to one code at a time
    (and to the long-code path) and still write the walk's bytes."""
    rng = np.random.default_rng(tile)
    n = 3 * tile + 100
    a = rng.integers(0, 2**16, n, dtype=np.uint16)
    b = a.copy()
    for t in range(3):
        s = t * tile
        b[s : s + tile // 2] += np.uint16(1)  # a dense run: k = 0
        b[s + tile - 3] += np.uint16(2)  # then a gap of half a tile
        b[s + tile - 1] -= np.uint16(1)
    b[-1] += np.uint16(5)
    for update in (False, True):
        walked = _scan_with("walk", a, b, tile, update, cast=False)
        assert _scan_with("compress", a, b, tile, update, cast=False) == walked
        assert _scan_with("lanes", a, b, tile, update, cast=False) == walked
    changed, stream = tile_encode.encode_huffman(a, b, tile)
    assert stream is not None and changed == int((a != b).sum())


def _tile_with_gaps(lead_gaps: list[int], last_gap: int | None = None, tile: int = 4096) -> np.ndarray:
    """Positions in one tile: the gaps ``lead_gaps`` first, then a change every 9th element
    (so the tile's Rice parameter is 3 whatever the few long gaps add), then, with
    ``last_gap``, one more change that many elements after the last."""
    pos = np.cumsum(np.array(lead_gaps, np.int64) + 1) - 1
    rest = np.arange(pos[-1] + 10, tile - (0 if last_gap is None else last_gap + 1), 9)
    tail = [] if last_gap is None else [rest[-1] + last_gap + 1]
    return np.concatenate([pos, rest, tail]).astype(np.uint16)


@pytest.mark.parametrize("lead_gaps, last_gap, count", [
    ([150, 151, 152, 153], None, None),  # four codes of 22 bits: 88 > 56, appended two by two
    ([195, 0, 0, 0, 5], None, None),  # the longest code of a group: 24 + 1 + 3 = 28 bits
    ([200, 3], None, None),  # a 29-bit code: its group goes code by code
    ([1000, 0, 5, 300, 1, 2], None, None),  # unary parts of 125 and 37 bits (32 one-bits an append)
    ([7], None, 401),  # a count that is not a multiple of four
    ([7], 700, None),  # a long code among the last, ungrouped ones
])
def test_the_grouped_rice_pass_writes_the_walks_bits(lead_gaps: list[int], last_gap: int | None,
                                                     count: int | None) -> None:
    pos = _tile_with_gaps(lead_gaps, last_gap)[:count]
    cnt = pos.size
    assert (count is None and last_gap is None) or cnt % 4 != 0
    k = tile_blocks.rice_k(int(pos[-1]) + 1 - cnt, cnt)
    assert k == 3  # the premise of the code lengths above
    buf = np.full(4096 + 64, 0xEE, np.uint8)
    codes, lens = np.empty(cnt, np.uint32), np.empty(cnt, np.uint32)
    end = tile_blocks.rice_tile_grouped(pos, cnt, k, buf, 0, codes, lens)
    a = np.zeros(4096, np.uint16)
    b = a.copy()
    b[pos.astype(np.int64)] = 1
    walked = _scan_with("walk", a, b, 4096, False, cast=False)
    (ns, ks, rice_len, *_), ((walk_rice, _, _),), _ = walked
    assert (ns, ks) == ([cnt], [k])
    assert buf[:end].tobytes() == walk_rice and end == rice_len[0]
    for kernel in ("compress", "lanes"):  # the scan that calls it writes the same
        assert _scan_with(kernel, a, b, 4096, False, cast=False) == walked


@pytest.mark.parametrize("kernel", ["compress", "lanes"])
def test_a_tile_whose_rice_bound_exceeds_its_scratch_is_refused_untouched(kernel: str) -> None:
    """The packed scan codes a tile's gaps only when their bound fits its Rice scratch, which
    ``rice_k`` always leaves with the codec's stride; with a stride too small for it the tile
    is refused (the two-step encoder takes it) and nothing past the stride is written."""
    tile, rstride = 4096, 48
    a = np.zeros(2 * tile, np.uint16)
    b = a.copy()
    b[[5, 9]] = 1  # tile 0: two changes, a few bits
    b[tile::3] = 1  # tile 1: hundreds of bytes of Rice bits
    rice = np.full(2 * rstride + 64, 0xEE, np.uint8)
    syms = np.zeros(2 * 2 * tile, np.uint8)
    ns, ks, rice_len, n_esc, counts, over = tile_scan.scan_encode_tiles_packed(
        a, b, 2, tile, rice, rstride, syms, False, *tile_scan.packed_scan_args(None, kernel == "compress"))
    assert over.tolist() == [0, 1] and ns[1] == (tile + 2) // 3 and 0 < rice_len[0] < rstride - 16
    assert (rice[rstride:] == 0xEE).all()


@given(gaps=st.lists(st.integers(0, 70) | st.integers(0, 5000), min_size=1, max_size=30), k=st.integers(0, 24))
@settings(max_examples=200, deadline=None)
def test_the_byte_writers_rice_codes_are_the_word_writers(gaps: list[int], k: int) -> None:
    """``entropy.rice_bytes_put`` (the grouped pass's long codes) writes the bits of
    ``entropy.rice_put`` (the one-walk scan's), unary parts of thousands of bits included."""
    from weftboard.cuda import entropy

    gaps = [g << (k // 2) for g in gaps]  # a parameter that fits the gaps as well as one that does not
    room = sum((g >> k) + 1 + k for g in gaps) // 8 + 64
    words, chars = np.zeros(room, np.uint8), np.zeros(room, np.uint8)
    p, acc, nbits = 0, 0, 0
    q, qacc, qbits = 0, np.uint64(0), np.uint64(0)
    for g in gaps:
        p, acc, nbits = entropy.rice_put(words, p, acc, nbits, g, k, (1 << k) - 1)
        q, qacc, qbits = entropy.rice_bytes_put(chars, q, qacc, qbits, np.uint64(g), np.uint64(k))
    end = entropy.rice_flush(words, p, acc, nbits)
    assert entropy.rice_flush(chars, q, int(qacc), int(qbits)) == end
    assert chars[:end].tobytes() == words[:end].tobytes()


def test_a_scratch_pool_shared_across_tensors_gives_each_its_own_bytes() -> None:
    """``encode_patch`` keeps one scratch pool for all its tensors: buffers left dirty by a
    larger, denser tensor must not leak into the next one's stream."""
    pairs = [_pair(2, n, density, seed=n, far=far) for n, density, far in
             [(300_000, 0.3, 0.2), (5_000, 0.01, 0.0), (150_001, 0.05, 0.01), (64, 1.0, 1.0), (90_000, 0.02, 0.0)]]
    scratch: dict = {}
    for a, b in pairs:
        alone = tile_encode.encode_huffman(a, b, CODEC_TILE)
        pooled = tile_encode.encode_huffman(a, b, CODEC_TILE, scratch)
        assert pooled[0] == alone[0]
        assert (pooled[1] is None) == (alone[1] is None)
        if alone[1] is not None:
            assert pooled[1].tobytes() == alone[1].tobytes()
    first = {key: buf for key, buf in scratch.items()}
    tile_encode.encode_huffman(*pairs[1], CODEC_TILE, scratch)  # smaller: the pool's buffers are reused
    assert all(scratch[key] is buf for key, buf in first.items())


@given(specs=st.lists(st.tuples(st.integers(0, 3 * 256 + 70), st.sampled_from([0.0, 0.01, 0.3, 1.0]),
                                 st.sampled_from([0.0, 0.3])), max_size=6),
       width=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1 << 16))
@settings(max_examples=60, deadline=None)
def test_a_batch_gives_each_pair_the_changes_and_stream_it_gets_alone(specs: list, width: int, seed: int) -> None:
    """``encode_huffman_batch`` scans every pair's tiles in one loop and codes them in
    another, each tile in slots numbered across the batch: each pair must still get exactly
    what ``encode_huffman`` gives it alone (its stream, or None where a tile overflowed)."""
    tile = 256  # many tiles from small pairs; far jumps overflow some tiles' escape room
    pairs = [_pair(width, n, density, seed + i, far) for i, (n, density, far) in enumerate(specs)]
    got = tile_encode.encode_huffman_batch(pairs, tile, {})
    assert len(got) == len(pairs)
    for (a, b), (changed, stream) in zip(pairs, got):
        want_changed, want = tile_encode.encode_huffman(a, b, tile)
        assert changed == want_changed
        assert (stream is None) == (want is None)
        if want is not None:
            assert stream is not None and stream.tobytes() == want.tobytes()


def test_a_batch_refuses_mixed_widths_and_wide_elements() -> None:
    assert tile_encode.encode_huffman_batch([], CODEC_TILE) == []
    with pytest.raises(ValueError, match="one element width"):
        tile_encode.encode_huffman_batch([_pair(2, 100, 0.1, 1), _pair(4, 100, 0.1, 2)], CODEC_TILE)
    with pytest.raises(ValueError, match="1-, 2- or 4-byte elements"):
        tile_encode.encode_huffman_batch([_pair(8, 100, 0.1, 1)], CODEC_TILE)
    a, b = _pair(2, 100, 0.1, 1)
    with pytest.raises(ValueError, match="one dtype and size"):
        tile_encode.encode_huffman_batch([(a, b[:50])], CODEC_TILE)


def _tensor(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[bits.itemsize])).view(
        DTYPE_OF_WIDTH[bits.itemsize])


def _patch_one_pair_at_a_time(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], encoding: str) -> bytes:
    """``encode_patch`` as it was before batches: each pair encoded alone, in order."""
    entries = []
    for name, old, new in pairs:
        if encoding == "context":
            entry = encode._encode_pair_context(name, old, new)
            if entry is not None:
                entries.append(entry)
                continue
        a, b = tensor_bits.cpu_bits(old), tensor_bits.cpu_bits(new)
        entry = encode._fused_result(name, old.dtype, b, *tile_encode.encode_huffman(a, b, CODEC_TILE))
        entries.append(entry if entry is not None else encode._encode_delta(name, diff_tensor(old, new), encoding))
    return codec.assemble_patch(entries, base_version=1, target_version=2, target_root=ROOT, encoding=encoding).data


@pytest.mark.parametrize("batch_tiles", [1, 3, 256])
@pytest.mark.parametrize("encoding", ["default", "context"])
def test_encode_patch_in_batches_writes_the_patch_of_one_pair_at_a_time(monkeypatch: pytest.MonkeyPatch,
                                                                        batch_tiles: int, encoding: str) -> None:
    """Batches close on a full batch and on a change of element width, and a pair the fused
    encoder leaves (wide elements, a bitmap-sized change, all changed) or the context encoding
    takes flushes the batch first: the container is byte for byte the one-pair-at-a-time one,
    and applies bitwise."""
    monkeypatch.setattr(encode, "BATCH_TILES", batch_tiles)
    specs = [(2, 2 * CODEC_TILE + 5, 0.02, 0.0), (2, 1000, 0.1, 0.01), (2, 0, 0.0, 0.0), (4, 700, 0.05, 0.0),
             (2, 64, 1.0, 0.0), (1, 5000, 0.2, 0.3), (8, 300, 0.1, 0.0), (2, CODEC_TILE, 0.0, 0.0),
             (2, 90_000, 0.4, 0.0), (1, 3 * CODEC_TILE, 0.01, 0.0), (2, 513, 0.03, 0.0)]
    pairs = [(f"t{i}", _tensor(a), _tensor(b)) for i, (w, n, d, far) in enumerate(specs)
             for a, b in [_pair(w, n, d, seed=i, far=far)]]
    data = encode_patch(iter(pairs), base_version=1, target_version=2, target_root=ROOT, encoding=encoding).data
    assert data == _patch_one_pair_at_a_time(pairs, encoding)
    modes = {t.name: t.mode for t in codec.read_patch_info(data).tensors}
    assert modes["t2"] == modes["t7"] == "empty" and modes["t4"] == "all"
    assert "huffman" in modes.values() and (encoding == "default" or "context" in modes.values())
    target = {name: old.clone() for name, old, _ in pairs}
    apply_patch_(target, data)
    assert all(torch.equal(bits_view(target[name]), bits_view(new)) for name, _, new in pairs)


def _patch_of(pairs: list[tuple[np.ndarray, np.ndarray]]) -> bytes:
    return encode_patch(((f"t{i}", torch.from_numpy(a.view(np.int16)), torch.from_numpy(b.view(np.int16)))
                         for i, (a, b) in enumerate(pairs)), base_version=1, target_version=2, target_root="r").data


def test_encode_patch_keeps_its_scratch_for_the_next_patch_and_its_bytes_do_not_leak() -> None:
    """A publisher encodes a patch every step: the thread's scratch pool outlives one
    ``encode_patch`` (fresh scratch page-faults on every page it touches), and a patch
    encoded after a larger, denser one is byte for byte what it is on its own."""
    dense = [_pair(2, 400_000, 0.3, seed=1, far=0.2), _pair(2, 70_000, 0.5, seed=2, far=0.5)]
    light = [_pair(2, 200_000, 0.01, seed=3), _pair(2, 5_000, 0.02, seed=4)]
    scratch.kept_scratch().clear()
    alone = _patch_of(light)
    assert scratch.kept_scratch(), "encode_patch should leave its scratch in the thread's pool"
    _patch_of(dense)  # grows the pool's buffers and leaves them dirty
    grown = dict(scratch.kept_scratch())
    assert _patch_of(light) == alone
    pool = scratch.kept_scratch()
    assert pool.keys() == grown.keys() and all(pool[key] is buf for key, buf in grown.items())

    seen: list[dict] = []
    worker = threading.Thread(target=lambda: seen.append(scratch.kept_scratch()))
    worker.start()
    worker.join()
    assert seen[0] is not pool, "each thread needs its own pool: a pooled buffer is valid until its next use"


def test_a_pool_above_the_kept_size_is_released_after_the_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    scratch.kept_scratch().clear()
    monkeypatch.setattr(scratch, "KEPT_SCRATCH_BYTES", 1 << 20)  # the 400k-element pair's scratch is larger
    patch = _patch_of([_pair(2, 400_000, 0.05, seed=5)])
    assert scratch.kept_scratch() == {}
    monkeypatch.setattr(scratch, "KEPT_SCRATCH_BYTES", 1 << 40)
    assert _patch_of([_pair(2, 400_000, 0.05, seed=5)]) == patch
    assert scratch.kept_scratch()


@pytest.mark.parametrize("cut", [1, 2])
def test_a_tile_whose_rans_bytes_end_early_is_refused_and_undone(cut: int) -> None:
    """The decoder reads both candidate renormalisation bytes without a branch (they may lie
    past the tile's rANS bytes, in its escapes or the next tile); a symbol that needs a byte
    past its tile's recorded end must still be refused (error 6 or 7, never a write that
    stays). Here the last tile's recorded rANS length is cut short, so its last bytes are
    still in the buffer, readable but not the tile's. A format 1 stream of +-1 steps (no
    escapes), from a committed fixture: the ``sparse`` writer was retired."""
    from weftboard.cuda import entropy

    fx = load_patch_fixture("bf16_small_tiles")
    entry, a = fx.entries["no_escapes"], fx.base["no_escapes"]
    assert entry["mode"] == "sparse" and entry["numel"] > 2 * entry["tile"]
    sp = decode.parse_tile_stream(entry, np.frombuffer(fx.stream("no_escapes"), np.uint8), 2)
    last = sp.ns.size - 1
    assert sp.esc[last] == 0  # its rANS bytes end the stream: the reads near the end take the guarded path
    rans = sp.rans.copy()
    rans[last] -= cut
    target = a.copy()
    errs, done = tile_decode.apply_tiles(sp.buf, target, sp.numel, sp.tile, sp.width, sp.ns, sp.ks, sp.rice, rans,
                                        sp.esc, sp.offs, sp.freq, sp.cum, sp.slot2sym, 1, sp.ns)
    assert errs[:last].tolist() == [0] * last
    assert errs[last] in (6, 7), entropy.ERRORS.get(int(errs[last]))
    tile_decode.apply_tiles(sp.buf, target, sp.numel, sp.tile, sp.width, sp.ns, sp.ks, sp.rice, rans, sp.esc, sp.offs,
                           sp.freq, sp.cum, sp.slot2sym, -1, done)
    assert np.array_equal(target, a)  # every write the refused apply made, undone


def _rice_bytes(gaps: list[int], k: int, lead: int) -> tuple[np.ndarray, int, int]:
    """``gaps`` Rice(k)-coded by the encoder's writer after ``lead`` bytes of 0xFF and followed
    by at least 32 bytes of 0xFF (what lies past a tile's Rice bits is its rANS bytes, not
    zeros): the buffer, where the bits start and where they end (bytes)."""
    from weftboard.cuda import entropy

    unary_bytes = sum(g >> k for g in gaps) // 8
    buf = np.full(lead + unary_bytes + 3 * len(gaps) + 64, 0xFF, np.uint8)  # a code's rest: k + 1 <= 16 bits
    buf[lead:] = 0
    p, acc, nbits = lead, 0, 0
    for g in gaps:
        p, acc, nbits = entropy.rice_put(buf, p, acc, nbits, g, k, (1 << k) - 1)
    end = entropy.rice_flush(buf, p, acc, nbits)
    buf[end:] = 0xFF
    return buf, lead, end


def _read_gaps(buf: np.ndarray, start: int, end: int, n: int, k: int, tile: int) -> tuple[list[int], bool, int]:
    """Up to ``n`` gaps read back with the decoder's Rice reader: (gaps, whether the reader
    ended exactly at the writer's padding, the error code of the read that failed or 0)."""
    gaps, p, acc, nbits = [], start, 0, 0
    for _ in range(n):
        g, p, acc, nbits, err = tile_decode.rice_gap(buf, p, end, acc, nbits, k, (1 << k) - 1, tile)
        if err:
            return gaps, False, err
        assert 8 * p - nbits <= 8 * end, "a code was read from bits past the end"
        gaps.append(g)
    return gaps, p == end and nbits < 8 and acc == 0, 0


@given(codes=st.lists(st.tuples(st.integers(0, 70) | st.integers(0, 3000), st.integers(0, (1 << 15) - 1)),
                     min_size=1, max_size=40),
       k=st.integers(0, 15), lead=st.integers(0, 9))
@settings(max_examples=200, deadline=None)
def test_the_rice_reader_reads_back_what_the_writer_wrote(codes: list[tuple[int, int]], k: int, lead: int) -> None:
    """The decoder's Rice reader tops up from one 8-byte read away from the end of its bits,
    byte by byte near it, and loops over unary parts longer than what it holds (drawn often
    here: up to 3000 bits). Whatever the mix, the gaps the encoder's writer wrote come back,
    the reader ends exactly at the writer's padding, a set padding bit or a missing last byte
    is refused, and the bytes past the end (0xFF here, as a tile's rANS bytes would be) are
    never taken for bits."""
    gaps = [(u << k) | (low & ((1 << k) - 1)) for u, low in codes]
    buf, start, end = _rice_bytes(gaps, k, lead)
    got, ends, err = _read_gaps(buf, start, end, len(gaps), k, tile=1 << 20)
    assert err == 0 and got == gaps and ends
    pad = (-sum((g >> k) + 1 + k for g in gaps)) % 8
    if pad:  # a padding bit set is refused
        bad = buf.copy()
        bad[end - 1] |= np.uint8(0x80)
        assert _read_gaps(bad, start, end, len(gaps), k, tile=1 << 20)[1:] == (False, 0)
    short, ends, err = _read_gaps(buf, start, end - 1, len(gaps), k, tile=1 << 20)  # the last byte cut off
    assert err == 1  # the last byte always holds bits of the last code


def test_a_unary_run_longer_than_a_tile_is_refused() -> None:
    buf = np.full(64, 0xFF, np.uint8)  # all ones: a unary part that never ends within the bits
    assert _read_gaps(buf, 0, 60, 1, 0, tile=100)[2] == 2
    assert _read_gaps(buf, 0, 60, 1, 0, tile=1 << 16)[2] == 1  # ... or runs past the end first


@pytest.mark.parametrize("tile", [4096, CODEC_TILE])
def test_long_unary_codes_decode_and_apply_bitwise(tile: int) -> None:
    """Clustered changes give a tile a small Rice parameter, so a lone far change has a unary
    part of thousands of bits: the decoder's careful path, in the middle of a tile's bits.
    Both streams: format 1's ``sparse`` one (a committed fixture in tiles of 4096), and the
    ``huffman`` one written here."""
    rng = np.random.default_rng(5)
    n = 3 * tile + 100
    a = rng.integers(0, 2**16, n, dtype=np.uint16)
    b = a.copy()
    for t in range(3):
        s = t * tile
        b[s : s + 700] += np.uint16(1)
        b[s + tile // 2] -= np.uint16(1)
        b[s + tile - 2] += np.uint16(3)
    b[-1] += np.uint16(5)
    changed, huff = tile_encode.encode_huffman(a, b, tile)
    assert huff is not None
    streams = [(dict(_entry(2, n, changed), tile=tile), huff.tobytes())]
    fx = load_patch_fixture("bf16_small_tiles")
    if tile == fx.entries["long_unary"]["tile"]:
        assert np.array_equal(fx.base["long_unary"], a) and np.array_equal(fx.expected["long_unary"], b)
        streams.append((fx.entries["long_unary"], fx.stream("long_unary")))
    for entry, stream in streams:
        dec = decode_stream(entry, memoryview(stream))
        assert np.array_equal(dec.positions, np.flatnonzero(a != b))
        target = a.copy()
        sp = decode.parse_tile_stream(entry, np.frombuffer(stream, np.uint8), 2)
        decode.apply_tile_stream_(torch.from_numpy(target.view(np.int16)), entry, sp, 1)
        assert np.array_equal(target, b), entry["mode"]


def _damaged_streams(sp: decode.TileStream, rng: np.random.Generator) -> list[tuple[str, decode.TileStream]]:
    """``sp`` with one thing wrong each: a byte flipped in a tile's Rice bits, its value bits
    or its escapes, a section's recorded length one byte short or long, a Rice parameter one
    off, or the buffer cut right after the last tile's bytes (the readers' end-of-buffer
    paths)."""
    out = []
    for t in range(sp.ns.size):
        start, rend = int(sp.offs[t]), int(sp.offs[t] + sp.rice[t])
        aend = rend + int(sp.rans[t])
        eend = aend + int(sp.esc[t]) * sp.width
        for what, lo, hi in (("rice", start, rend), ("values", rend, aend), ("escapes", aend, eend)):
            for _ in range(3 if hi > lo else 0):
                buf = sp.buf.copy()
                at = int(rng.integers(lo, hi))
                buf[at] ^= np.uint8(rng.integers(1, 256))
                out.append((f"tile {t}: {what} byte {at} flipped", dataclasses.replace(sp, buf=buf)))
        for field_name in ("rice", "rans", "esc", "ks"):
            for delta in (-1, 1):
                arr = getattr(sp, field_name).copy()
                arr[t] += delta
                if arr[t] >= 0:
                    out.append((f"tile {t}: {field_name} {delta:+d}", dataclasses.replace(sp, **{field_name: arr})))
    cut = int(sp.offs[-1] + sp.rice[-1] + sp.rans[-1] + sp.esc[-1] * sp.width)
    out.append(("the buffer cut after its last tile's bytes", dataclasses.replace(sp, buf=sp.buf[:cut].copy())))
    return out


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("sign", [1, -1])
def test_the_register_apply_gives_the_bit_position_loops_verdicts_on_damaged_streams(width: int, sign: int) -> None:
    """A Huffman stream of 8- or 16-bit elements is applied by ``_apply_huffman_tile`` (its
    bits in registers), and decoded into arrays by the loop that reads at bit positions. On
    every damage below the two give each tile the same error code and stop at the same
    change, the apply writes exactly the first differences the decoder found, and undoing
    those writes restores the target."""
    rng = np.random.default_rng(50 + width)
    a, b = _pair(width, 3 * CODEC_TILE + 777, 0.04, seed=60 + width, far=0.02)  # escapes in every tile
    changed, stream = tile_encode.encode_huffman(a, b, CODEC_TILE)
    assert stream is not None
    sp = decode.parse_tile_stream(_entry(width, a.size, changed, "huffman"), stream, width)
    assert (sp.esc > 0).all() and sp.freq is None
    mask = (1 << (8 * width)) - 1
    cases = [("undamaged", sp)] + _damaged_streams(sp, rng)
    verdicts = set()
    for label, d in cases:
        pos = np.full(changed, -1, np.int64)
        diff = np.zeros(changed, UNSIGNED[width])
        errs_dec = tile_decode.decode_tiles(d.buf, d.numel, d.tile, width, d.ns, d.ks, d.rice, d.rans, d.esc, d.offs,
                                           None, None, d.slot2sym, pos, diff)
        target = a.copy()
        errs, done = tile_decode.apply_tiles(d.buf, target, d.numel, d.tile, width, d.ns, d.ks, d.rice, d.rans, d.esc,
                                            d.offs, None, None, d.slot2sym, sign, d.ns)
        assert errs.tolist() == errs_dec.tolist(), label
        want = a.astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(d.ns)])
        for t in range(d.ns.size):
            written = pos[starts[t]:starts[t + 1]]
            stop = int(np.argmax(written < 0)) if (written < 0).any() else written.size
            assert done[t] == stop, (label, t)
            at = written[:stop]
            want[at] = (want[at] + sign * diff[starts[t]:starts[t] + stop].astype(np.int64)) & mask
        assert np.array_equal(target.astype(np.int64), want), label
        tile_decode.apply_tiles(d.buf, target, d.numel, d.tile, width, d.ns, d.ks, d.rice, d.rans, d.esc, d.offs, None,
                               None, d.slot2sym, -sign, done)
        assert np.array_equal(target, a), label
        verdicts.update(int(e) for e in errs)
    assert {0, 1, 2, 3, 6, 7, 8} <= verdicts, verdicts  # the damage reached each of the checks
