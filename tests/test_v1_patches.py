"""Committed patch fixtures decode bitwise.

The format 1 ``sparse`` stream (rANS-coded values) is read but no longer written: its writer
was retired, and what it wrote lives on as the patches under tests/data/v1_patches (README
there); format 3's ``context_huffman`` streams, from before format 4's empty pieces, as those
under tests/data/v3_patches. Every committed patch fixture under tests/data must apply to exactly its expected
tensors (and revert), and each of its streams must decode, with the two-step decoder and with
the fused decode+apply kernel, to exactly the differences between its base and expected tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from patchkit import V1_PATCHES, PatchFixture, load_patch_fixture, patch_fixture_paths

from weftboard.cuda import decode
from weftboard.cuda.codec import apply_patch_, decode_stream, read_patch_info
from weftboard.cuda.diff import bits_view

PATHS = patch_fixture_paths()
V1 = sorted(V1_PATCHES.glob("*.safetensors"))


def _bits(t: torch.Tensor, like: np.ndarray) -> np.ndarray:
    return bits_view(t).numpy().view(like.dtype)


def test_the_v1_fixtures_are_there_and_found() -> None:
    assert len(V1) >= 5 and set(V1) <= set(PATHS)
    assert sum(p.stat().st_size for p in PATHS) < 2 << 20  # kept small


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_every_patch_fixture_applies_bitwise_and_reverts(path) -> None:
    fx = load_patch_fixture(path)
    if path.parent == V1_PATCHES:
        assert read_patch_info(fx.data).format_version == 1
    target = fx.tensors("base")
    applied = apply_patch_(target, fx.data)
    for name, want in fx.expected.items():
        assert np.array_equal(_bits(target[name], want), want), name
        assert applied.changed[name] == int((fx.base[name] != want).sum())
    applied.revert()
    for name, want in fx.base.items():
        assert np.array_equal(_bits(target[name], want), want), name


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_every_stream_of_a_fixture_decodes_to_the_exact_differences(path) -> None:
    fx = load_patch_fixture(path)
    for name, entry in fx.entries.items():
        a, b = fx.base[name], fx.expected[name]
        if entry["mode"] == "empty":
            assert np.array_equal(a, b)
            continue
        stream = fx.stream(name)
        dec = decode_stream(entry, stream, a if entry["mode"] in ("context", "context_huffman") else None)
        pos = np.flatnonzero(a != b)
        order = np.argsort(dec.positions)  # a context stream's positions come class by class
        assert np.array_equal(dec.positions[order], pos), name
        with np.errstate(over="ignore"):  # the wrapping difference, or the new bits
            want = b[pos] - a[pos] if dec.is_difference else b[pos]
        assert np.array_equal(dec.values[order].astype(a.dtype), want), name
        if entry["mode"] in ("sparse", "huffman"):  # the fused decode+apply kernel, both ways
            _fused_apply_both_ways(fx, name)


def _fused_apply_both_ways(fx: PatchFixture, name: str) -> None:
    entry, a, b = fx.entries[name], fx.base[name], fx.expected[name]
    target = fx.tensors("base")[name]
    sp = decode.parse_tile_stream(entry, np.frombuffer(fx.stream(name), np.uint8), a.itemsize)
    decode.apply_tile_stream_(target, entry, sp, 1)
    assert np.array_equal(_bits(target, b), b), name
    decode.apply_tile_stream_(target, entry, sp, -1)
    assert np.array_equal(_bits(target, a), a), name


def test_the_v1_fixtures_cover_what_the_reader_must_handle() -> None:
    """Element widths 1, 2, 4 and 8 in the dtypes that had them, tensors of several tiles,
    codec tiles and smaller ones, tiles with every element changed, escapes, sign flips and
    NaN payloads, tiny tensors; and the other modes a format 1 patch could hold."""
    dtypes, modes, tiles = set(), set(), set()
    multi_tile = full_tile = escapes = nan = flips = tiny = False
    for path in V1:
        fx = load_patch_fixture(path)
        for name, entry in fx.entries.items():
            modes.add(entry["mode"])
            if entry["mode"] != "sparse":
                continue
            a, b = fx.base[name], fx.expected[name]
            dtypes.add(entry["dtype"])
            tiles.add(entry["tile"])
            sp = decode.parse_tile_stream(entry, np.frombuffer(fx.stream(name), np.uint8), a.itemsize)
            sizes = np.minimum(entry["tile"], entry["numel"] - entry["tile"] * np.arange(sp.ns.size))
            multi_tile |= sp.ns.size > 1
            full_tile |= bool((sp.ns == sizes).any() and sizes.max() > 64)
            escapes |= bool(sp.esc.any())
            tiny |= entry["numel"] < 64
            top = a.dtype.type(1 << (8 * a.itemsize - 1))
            flips |= bool(((a ^ b) == top).any())
            if entry["dtype"].startswith(("bfloat", "float")):
                nan |= bool(torch.isnan(fx.tensors("expected")[name].float()).any())
    assert {"bfloat16", "float16", "float8_e4m3fn", "uint8", "float32", "int32", "int64", "float64"} <= dtypes
    assert {"sparse", "all", "empty", "bitmap"} <= modes
    assert len(tiles) >= 3 and multi_tile and full_tile and escapes and nan and flips and tiny
