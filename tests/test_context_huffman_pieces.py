"""Format 4's empty pieces in ``context_huffman`` streams (``cuda/FORMAT.md`` 2.7).

What must hold: a class whose every member in a tile changed is written without a Rice piece
(``k`` 0, length 0) and decodes to every member; such streams are smaller than format 3's
streams of the same pair (the committed fixtures under tests/data/v3_patches, which still
decode bitwise through ``test_v1_patches``); an empty piece with a non-zero ``k``, or for a
class where not every member changed, is refused as damaged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from patchkit import DATA, load_patch_fixture, optimizer_step, u16

from weftboard.cuda import container
from weftboard.cuda import context_codec as cc
from weftboard.cuda import context_huffman as ch
from weftboard.cuda.codec import CODEC_TILE, encode_patch, read_patch_info

ROOT = "xxh3-128:" + "00" * 16
V3 = DATA / "v3_patches"


def _pieces(stream: ch.ContextHuffmanStream, old: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(changes, members, k, Rice bytes) per (tile, class) of a parsed stream over ``old``."""
    ntiles, ncls = stream.ns.shape
    ks = stream.flat[ntiles * ncls:2 * ntiles * ncls].reshape(ntiles, ncls)
    rice = stream.flat[2 * ntiles * ncls:3 * ntiles * ncls].reshape(ntiles, ncls)
    cls = np.searchsorted(stream.thr, (old & 0x7FFF).astype(np.int64), side="right")
    members = np.zeros((ntiles, ncls), np.int64)
    for t in range(ntiles):
        members[t] = np.bincount(cls[t * stream.tile:(t + 1) * stream.tile], minlength=ncls)
    return stream.ns, members, ks, rice


def _first_step(n: int = 2 * CODEC_TILE + 999) -> tuple[np.ndarray, np.ndarray, ch.ContextHuffmanStream]:
    old, new = optimizer_step(n, torch.bfloat16, seed=21, steps=1)
    a, b = u16(old), u16(new)
    changed, stream, _ = ch.encode_context_huffman(a, b, cc.choose_thresholds(a, torch.bfloat16), CODEC_TILE)
    assert stream is not None
    return a, b, ch.ContextHuffmanStream(stream, a.size, CODEC_TILE, changed)


def test_a_class_whose_every_member_changed_has_no_piece_and_decodes_to_every_member() -> None:
    a, b, stream = _first_step()
    ns, members, ks, rice = _pieces(stream, a)
    every = (ns == members) & (ns > 0)
    assert every.sum() >= 3, (ns, members)  # the smallest magnitudes move at a first AdamW step
    assert (rice[every] == 0).all() and (ks[every] == 0).all()
    partial = (ns > 0) & (ns < members)
    assert partial.any() and (rice[partial] > 0).all()
    pos, diff = stream.decode(a)
    assert np.array_equal(pos, np.flatnonzero(a != b)) and np.array_equal(a[pos] + diff, b[pos])


@pytest.mark.parametrize("name", ["bf16_step", "fp16_steps"])
def test_format_3_fixtures_are_what_they_say_and_the_writer_now_makes_them_no_larger(name: str) -> None:
    fx = load_patch_fixture(V3 / f"{name}.safetensors")
    assert read_patch_info(fx.data).format_version == 3
    pairs = []
    for tensor, e in fx.entries.items():
        dtype = container.torch_dtype(e["dtype"], tensor)
        pairs.append((tensor, torch.from_numpy(fx.base[tensor].view(np.int16)).view(dtype),
                      torch.from_numpy(fx.expected[tensor].view(np.int16)).view(dtype)))
    now = read_patch_info(encode_patch(pairs, base_version=7, target_version=8, target_root=ROOT,
                                       encoding="compact").data)
    assert now.format_version == 4
    before = {t.name: t for t in read_patch_info(fx.data).tensors}
    for t in now.tensors:
        assert t.mode == before[t.name].mode and t.stream_bytes <= before[t.name].stream_bytes, t.name
    if name == "bf16_step":  # whole classes moved: their pieces are gone
        assert now.tensors[0].stream_bytes < before["w"].stream_bytes


def test_an_empty_piece_with_a_rice_parameter_is_refused() -> None:
    a, _, stream = _first_step()
    ns, members, ks, _ = _pieces(stream, a)
    t, c = np.argwhere((ns == members) & (ns > 0))[0]
    ntiles, ncls = ns.shape
    stream.flat[ntiles * ncls + t * ncls + c] = 3
    with pytest.raises(ValueError, match="Rice parameter"):
        stream.decode(a)


def test_an_empty_piece_where_not_every_member_changed_is_refused() -> None:
    a, _, stream = _first_step()
    ns, members, _, rice = _pieces(stream, a)
    t, c = np.argwhere((ns > 0) & (ns < members))[0]
    ntiles, ncls = ns.shape
    at = 2 * ntiles * ncls + t * ncls + c
    stream.flat[at] = 0
    with pytest.raises(ValueError, match="Rice"):
        stream.decode(a)
