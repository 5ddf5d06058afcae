"""The context-coded stream (``weftboard.cuda.context_codec``): classes by old magnitude.

What must hold: every pair round-trips bit for bit, in place and through arrays, for bf16 and
fp16 with escapes, NaNs, sign flips and partial tiles; on a realistic optimizer step the stream
is smaller than the i.i.d. ``huffman`` stream (that is its reason to exist); the container
accepts the mode only where it is valid; a damaged stream never leaves a tensor half-patched.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from patchkit import optimizer_step, u16, with_header

from weftboard.cuda import apply, codec, container, tile_encode
from weftboard.cuda import context_codec as cc
from weftboard.cuda.bitops import mag_ge_mask64
from weftboard.cuda.codec import (
    CODEC_TILE,
    apply_patch_,
    decode_stream,
    encode_patch,
    read_patch_info,
)
from weftboard.cuda.diff import bits_view
from weftboard.proto.errors import CorruptData, InvalidArgument

ROOT = "xxh3-128:" + "00" * 16


def test_magnitude_masks_match_an_element_by_element_compare() -> None:
    @numba.njit
    def mask(a, start, t):
        return mag_ge_mask64(a, start, t)

    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**16, 300, dtype=np.uint16)
    for start in (0, 1, 77, 236):
        for t in (0, 1, 0x3C00, 0x7F80, 0x7FFF):
            expected = sum(1 << j for j in range(64) if (int(a[start + j]) & 0x7FFF) >= t)
            assert int(mask(a, start, t)) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 63, 65, CODEC_TILE + 700, 3 * CODEC_TILE])
def test_streams_round_trip_in_place_and_through_arrays(dtype: torch.dtype, n: int) -> None:
    old, new = optimizer_step(n, dtype, seed=n)
    b = bits_view(new)
    b[: max(1, n // 97)] ^= 0x8000  # sign flips: escapes
    b[n // 2] = 0x7FC0 if dtype == torch.bfloat16 else 0x7E00  # a NaN
    b[-1] += 3000  # a far jump
    a, bu = u16(old), u16(new)
    thr = cc.choose_thresholds(a, dtype)
    assert thr.size
    changed, stream = cc.encode_context(a, bu, thr, CODEC_TILE)
    assert changed == int((a != bu).sum()) and stream is not None
    parsed = cc.ContextStream(stream, n, CODEC_TILE, changed)
    pos, diff = parsed.decode(a)
    assert np.unique(pos).size == changed
    rebuilt = a.copy()
    rebuilt[pos] += diff
    assert np.array_equal(rebuilt, bu)
    target = a.copy()
    undo = parsed.apply_(target)
    assert np.array_equal(target, bu)
    undo()
    assert np.array_equal(target, a)


def test_a_realistic_step_is_smaller_than_the_huffman_stream() -> None:
    old, new = optimizer_step(400_000, torch.bfloat16, seed=1, steps=1)
    a, b = u16(old), u16(new)
    changed, huff = tile_encode.encode_huffman(a, b, CODEC_TILE)
    _, context = cc.encode_context(a, b, cc.choose_thresholds(a, torch.bfloat16), CODEC_TILE)
    assert 0.005 < changed / a.size < 0.2
    assert context.size < 0.9 * huff.size, (context.size, huff.size)


def test_thresholds_are_checked_and_chosen_below_the_median_binade() -> None:
    a = u16(torch.full((5000,), 0.02, dtype=torch.bfloat16))
    thr = cc.choose_thresholds(a, torch.bfloat16)
    exponent = (int(a[0]) >> 7) & 0xFF
    assert list(thr) == [(exponent - cc.CLASSES + 1 + j) << 7 for j in range(cc.CLASSES - 1)]
    assert cc.choose_thresholds(np.zeros(100, np.uint16), torch.bfloat16).size == 0
    for bad in ([], [0], [0x80, 0x80], [0x8000], [0x3F81], [0x80 * j for j in range(1, 10)]):
        with pytest.raises(ValueError, match="thresholds"):
            cc.encode_context(a, a, np.array(bad, np.int64), CODEC_TILE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_thresholds_end_one_binade_below_the_samples_median_exponent(dtype: torch.dtype) -> None:
    """The sample: every element up to 4,096, else 64 runs of 64 spread from the first element to the last."""
    shift, emask = (7, 0xFF) if dtype == torch.bfloat16 else (10, 0x1F)
    gen = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 64, 4095, 4096, 4097, 8191, 8192, 100_003):
        for scale in (1e-3, 0.02, 1.0, 100.0):
            t = (torch.randn(n, generator=gen) * scale).to(dtype)
            t[: n // 3] = 0  # a heavy low tail moves the median, and an even sample has two middles
            a = u16(t)
            sample = a if n <= 4096 else np.concatenate([a[s:s + 64] for s in (np.arange(64) * (n - 64) // 63)])
            med = int(np.median((sample >> shift) & emask))  # the mean of the two middles, truncated
            want = [e << shift for e in range(med - cc.CLASSES + 1, med) if e >= 1]
            assert cc.choose_thresholds(a, dtype).tolist() == want, (n, scale)
    assert cc.choose_thresholds(np.zeros(0, np.uint16), dtype).size == 0


def test_context_patches_mix_modes_apply_and_revert() -> None:
    old16, new16 = optimizer_step(200_000, torch.bfloat16, seed=2, steps=3)
    zeros = torch.zeros(5000, dtype=torch.bfloat16)  # no spread to classify: default modes
    zeros_new = zeros.clone()
    zeros_new[7] = 1.0
    old32 = torch.randn(3000)
    new32 = old32.clone()
    new32[::10] += 1
    olds = {"w": old16, "z": zeros, "f": old32}
    news = {"w": new16, "z": zeros_new, "f": new32}
    patch = encode_patch([(n, olds[n], news[n]) for n in olds], base_version=1, target_version=2, target_root=ROOT,
                         encoding="context")
    info = read_patch_info(patch.data)
    assert info.encoding == "context"
    assert {t.name: t.mode for t in info.tensors} == {"w": "context", "z": "huffman", "f": "huffman"}
    target = {n: t.clone() for n, t in olds.items()}
    applied = apply_patch_(target, patch.data)
    assert all(torch.equal(bits_view(target[n]), bits_view(news[n])) for n in news)
    applied.revert()
    assert all(torch.equal(bits_view(target[n]), bits_view(olds[n])) for n in olds)


def test_decoding_needs_the_old_bits_and_gives_differences() -> None:
    old, new = optimizer_step(90_000, torch.bfloat16, seed=4)
    patch = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT, encoding="context")
    c = container.read_container(patch.data)
    entry = c.entries[0]
    with pytest.raises(InvalidArgument, match="bits it applies to"):
        decode_stream(entry, c.streams["w"])
    dec = decode_stream(entry, c.streams["w"], u16(old))
    assert dec.is_difference
    target = old.clone()
    apply._apply_decoded(target, dec)  # the path CUDA destinations take, here on the CPU
    assert torch.equal(bits_view(target), bits_view(new))


def test_deltas_with_their_targets_encode_as_context_streams() -> None:
    from weftboard.cuda.diff import diff_tensor

    old, new = optimizer_step(70_000, torch.float16, seed=5, steps=1)
    delta = diff_tensor(old, new)
    with_target, = codec.encode_streams([("w", delta)], encoding="context", targets={"w": new})
    without, = codec.encode_streams([("w", delta)], encoding="context")
    assert (with_target.mode, without.mode) == ("context", "huffman")
    patch = codec.assemble_patch([with_target], base_version=1, target_version=2, target_root=ROOT, encoding="context")
    target = {"w": old.clone()}
    apply_patch_(target, patch.data)
    assert torch.equal(bits_view(target["w"]), bits_view(new))


def test_the_mode_is_refused_outside_the_context_encoding() -> None:
    old, new = optimizer_step(10_000, torch.bfloat16, seed=6)
    patch = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT, encoding="context")

    def to_default(header: dict) -> None:
        assert header["tensors"][0]["mode"] == "context"
        header["encoding"] = "default"  # with a consistent checksum: only the rule can refuse it

    forged = with_header(patch.data, to_default)
    with pytest.raises(CorruptData, match="not valid for encoding"):
        read_patch_info(forged)


def test_a_damaged_tile_undoes_every_write_of_the_apply() -> None:
    old, new = optimizer_step(3 * CODEC_TILE, torch.bfloat16, seed=7)
    a, b = u16(old), u16(new)
    changed, stream = cc.encode_context(a, b, cc.choose_thresholds(a, torch.bfloat16), CODEC_TILE)
    refused = 0
    for at in np.linspace(0.3, 0.99, 20):
        bad = stream.copy()
        bad[int(at * bad.size)] ^= 0x5A
        target = a.copy()
        try:
            parsed = cc.ContextStream(bad, a.size, CODEC_TILE, changed)
            parsed.apply_(target)
        except ValueError:
            refused += 1
            assert np.array_equal(target, a)
    assert refused >= 10


@pytest.mark.parametrize("cast", [False, True])
def test_scanning_piece_by_piece_folds_and_gives_the_whole_stream_and_delta(cast: bool) -> None:
    """The publisher's path: pieces scanned (fp32 masters cast inside the scan) and folded
    into the view; the stream equals the one-call encoder's, and the view plus the recorded
    class changes give the exact delta back."""
    gen = torch.Generator().manual_seed(8)
    n = 3 * CODEC_TILE + 999
    master = torch.randn(n, generator=gen) * 0.02
    master[:64] = torch.linspace(-1e-3, 1e-3, 64)  # crosses many binades: class changes
    old = master.to(torch.bfloat16)
    new_master = master + 1e-4 * torch.sign(torch.randn(n, generator=gen))
    new = new_master.to(torch.bfloat16)
    a, b = u16(old), u16(new)
    thr = cc.choose_thresholds(a, torch.bfloat16)
    view = a.copy()
    src = new_master.view(torch.int32).numpy().view(np.uint32) if cast else b
    cut = 2 * CODEC_TILE
    pieces = [cc.scan_tiles(view[lo:hi], src[lo:hi], thr, CODEC_TILE, {}, update=True, cast=cast)
              for lo, hi in ((0, cut), (cut, n))]
    assert np.array_equal(view, b)  # folded
    stream, fix_pos, fix_old = cc.finish_context(cc.ContextScans(thr, pieces))
    assert np.array_equal(stream, cc.encode_context(a, b, thr, CODEC_TILE)[1])
    assert fix_pos.size and np.all(a[fix_pos] == fix_old)
    parsed = cc.ContextStream(stream, n, CODEC_TILE, int((a != b).sum()))
    pos, diff = cc.decode_folded(parsed, view, fix_pos, fix_old)
    want = np.flatnonzero(a != b)
    order = np.argsort(pos)
    assert np.array_equal(pos[order], want) and np.array_equal(diff[order], (b[want] - a[want]).astype(np.uint16))


def test_a_cast_scan_leaves_nan_tiles_to_the_caller_untouched() -> None:
    gen = torch.Generator().manual_seed(9)
    n = 2 * CODEC_TILE
    master = torch.randn(n, generator=gen) * 0.02
    old = master.to(torch.bfloat16)
    moved = master + 1e-4
    moved[CODEC_TILE + 5] = float("nan")
    view = u16(old).copy()
    scan = cc.scan_tiles(view, moved.view(torch.int32).numpy().view(np.uint32), cc.choose_thresholds(view, torch.bfloat16),
                         CODEC_TILE, update=True, cast=True)
    assert scan.overflowed.tolist() == [1] and scan.ns[1].sum() == 0
    assert np.array_equal(view[CODEC_TILE:], u16(old)[CODEC_TILE:])  # left as it was
    assert np.array_equal(view[:CODEC_TILE], u16(moved.to(torch.bfloat16))[:CODEC_TILE])
