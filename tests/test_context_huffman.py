"""The context-Huffman stream (``weftboard.cuda.context_huffman``), the compact encoding's mode for
16-bit floats: positions by class of old magnitude, values Huffman-coded per class.

What must hold: every pair round-trips bit for bit (in place, undone, and through arrays with
ascending positions) for bf16 and fp16 with escapes, NaNs, sign flips, dense tiles and partial
blocks; ``pext``/``pdep`` and their portable loops agree; on a realistic optimizer step the stream
is smaller than the ``huffman`` stream and the compact encoding writes it (the default encoding
does not, and stamps format_version 2); a class whose every member changed has no Rice piece
(format_version 4), and format 3 patches still decode; a class with Rice parameter 0 is written
and read as its inverted member bitmap with the gap-by-gap coder's bytes, members and verdicts;
the container accepts the mode only from format_version 3 and only in the compact encoding; a
damaged stream never leaves a tensor half-patched; undo records held by earlier applies survive
later applies.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from patchkit import optimizer_step, u16, with_header

from weftboard.cuda import container, tile_encode
from weftboard.cuda import context_apply as ca
from weftboard.cuda import context_codec as cc
from weftboard.cuda import context_huffman as ch
from weftboard.cuda.bit_deposit import pdep64, pdep_portable, pext64, pext_portable
from weftboard.cuda.codec import (
    CODEC_TILE,
    apply_patch_,
    decode_stream,
    encode_patch,
    read_patch_info,
)
from weftboard.cuda.diff import bits_view
from weftboard.cuda.tile_blocks import rice_tile_grouped
from weftboard.proto.errors import CorruptData

ROOT = "xxh3-128:" + "00" * 16


def test_pext_and_pdep_match_their_portable_loops() -> None:
    @numba.njit
    def both(x, m):
        return pext64(x, m), pdep64(x, m), pext_portable(x, m), pdep_portable(x, m)

    rng = np.random.default_rng(0)
    words = [0, 1, 2**64 - 1, 2**63, *rng.integers(0, 2**63, 200, dtype=np.uint64).tolist()]
    for x, m in zip(words, words[::-1], strict=True):
        a, b, c, d = both(np.uint64(x), np.uint64(m))
        assert (a, b) == (c, d)


def _round_trip(a: np.ndarray, b: np.ndarray, dtype: torch.dtype, tile: int = CODEC_TILE) -> np.ndarray:
    thr = cc.choose_thresholds(a, dtype)
    assert thr.size
    changed, stream, guess = ch.encode_context_huffman(a, b, thr, tile)
    assert changed == int((a != b).sum()) and stream is not None and guess > 0
    parsed = ch.ContextHuffmanStream(stream, a.size, tile, changed)
    pos, diff = parsed.decode(a)
    assert np.array_equal(pos, np.flatnonzero(a != b))
    assert np.array_equal(a[pos] + diff, b[pos])
    target = a.copy()
    undo = parsed.apply_(target)
    assert np.array_equal(target, b)
    undo()
    assert np.array_equal(target, a)
    return stream


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 63, 65, 130, CODEC_TILE + 700, 3 * CODEC_TILE])
def test_streams_round_trip_in_place_and_through_arrays(dtype: torch.dtype, n: int) -> None:
    old, new = optimizer_step(n, dtype, seed=n)
    b = bits_view(new)
    b[: max(1, n // 97)] ^= 0x8000  # sign flips: escapes
    b[n // 2] = 0x7FC0 if dtype == torch.bfloat16 else 0x7E00  # a NaN
    b[-1] += 3000  # a far jump
    _round_trip(u16(old), u16(new), dtype)


@pytest.mark.parametrize("density", [0.001, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("tile", [256, 4096, CODEC_TILE])
def test_any_density_and_tile_round_trips(density: float, tile: int) -> None:
    rng = np.random.default_rng(int(density * 1000) + tile)
    a = u16((torch.randn(3 * tile + 77) * 0.02).to(torch.bfloat16))
    b = a.copy()
    hit = rng.random(a.size) < density
    hit[0] = True
    b[hit] = rng.integers(0, 2**16, int(hit.sum()), dtype=np.uint16)
    b[hit & (b == a)] += 1
    _round_trip(a, b, torch.bfloat16, tile)


def test_a_realistic_step_is_smaller_than_the_huffman_stream_and_the_compact_encoding_writes_it() -> None:
    old, new = optimizer_step(400_000, torch.bfloat16, seed=1, steps=1)
    a, b = u16(old), u16(new)
    changed, huff = tile_encode.encode_huffman(a, b, CODEC_TILE)
    stream = _round_trip(a, b, torch.bfloat16)
    assert 0.005 < changed / a.size < 0.2
    assert stream.size < 0.9 * huff.size, (stream.size, huff.size)
    default = read_patch_info(encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT).data)
    assert (default.format_version, default.tensors[0].mode) == (2, "huffman")  # readable by format 2 islands
    patch = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT, encoding="compact")
    info = read_patch_info(patch.data)
    assert (info.format_version, info.encoding, info.tensors[0].mode) == (4, "compact", "context_huffman")
    assert info.tensors[0].stream_bytes == stream.size < default.tensors[0].stream_bytes
    target = {"w": old.clone()}
    applied = apply_patch_(target, patch.data)
    assert torch.equal(bits_view(target["w"]), bits_view(new))
    applied.revert()
    assert torch.equal(bits_view(target["w"]), bits_view(old))
    c = container.read_container(patch.data)
    dec = decode_stream(c.entries[0], c.streams["w"], a)
    assert np.array_equal(dec.positions, np.flatnonzero(a != b))


def test_undo_records_held_by_earlier_applies_survive_later_applies() -> None:
    # The records come from a pool (``scratch.LeasePool``) that hands a buffer out again only
    # once no result refers to it: three chained steps applied with every result held, a
    # fourth apply whose result is dropped at once (its buffer is free for the next), then the
    # three reverted newest first give every step's bits back.
    steps = [optimizer_step(300_000, torch.bfloat16, seed=7, steps=1)[0]]
    for s in range(3):
        steps.append((steps[-1].float() + 3e-6 * torch.sign(torch.randn(300_000, generator=torch.Generator().manual_seed(s)))).to(torch.bfloat16))
    patches = [encode_patch([("w", a, b)], base_version=i + 1, target_version=i + 2, target_root=ROOT,
                            encoding="compact").data for i, (a, b) in enumerate(zip(steps, steps[1:]))]
    assert all(read_patch_info(p).tensors[0].mode == "context_huffman" for p in patches)
    target = {"w": steps[0].clone()}
    held = []
    for i, p in enumerate(patches):
        held.append(apply_patch_(target, p))
        other = {"w": steps[i].clone()}
        apply_patch_(other, p)  # dropped: its records go back to the pool
        assert torch.equal(bits_view(other["w"]), bits_view(steps[i + 1]))
        assert torch.equal(bits_view(target["w"]), bits_view(steps[i + 1]))
    for i in reversed(range(len(held))):
        held[i].revert()
        assert torch.equal(bits_view(target["w"]), bits_view(steps[i]))


def _read_both(piece: np.ndarray, n: int, members: int) -> tuple[int, np.ndarray, int, np.ndarray]:
    fast, slow = (np.zeros((members >> 6) + 2, np.uint64) for _ in range(2))
    e_fast = ca._unary_piece(piece, 0, piece.size, n, members, fast, 0)
    e_slow = ca._rice_piece(piece, 0, piece.size, 0, n, members, slow, 0, CODEC_TILE)
    return e_fast, fast, e_slow, slow


@pytest.mark.parametrize("seed", range(4))
def test_a_class_with_k_0_is_written_and_read_as_its_inverted_member_bitmap(seed: int) -> None:
    # Rice(0) codes a gap g as g one-bits and a zero-bit, so the piece is the member bitmap
    # inverted up to the last change: the scan writes it 64 members a store and the decoder
    # reads it so. Both must give the Rice writer's bytes and the gap-by-gap reader's members
    # and verdicts, on valid pieces and on damaged ones (bits flipped, a byte cut or added,
    # the count or the class size off by one).
    rng = np.random.default_rng(seed)
    verdicts = set()
    for _ in range(60):
        members = int(rng.integers(1, 900))
        changed = rng.random(members) < rng.choice([0.03, 0.4, 0.8, 0.99])
        changed[int(rng.integers(members))] = True
        pos = np.flatnonzero(changed).astype(np.uint16)
        n = pos.size
        ref = np.zeros(members // 8 + 32, np.uint8)
        end = rice_tile_grouped(pos, n, 0, ref, 0, np.zeros(n, np.uint32), np.zeros(n, np.uint32))
        mb = np.zeros((members >> 6) + 2, np.uint64)
        np.bitwise_or.at(mb, pos >> 6, np.left_shift(np.uint64(1), (pos & 63).astype(np.uint64)))
        out = np.full_like(ref, 0xEE)
        assert ch._unary_put(mb, 0, members, out, 0) == end
        assert np.array_equal(out[:end], ref[:end])
        piece = ref[:end].copy()
        e_fast, fast, e_slow, slow = _read_both(piece, n, members)
        assert e_fast == e_slow == 0 and np.array_equal(fast, mb) and np.array_equal(slow, mb)
        flipped = piece.copy()
        flipped[int(rng.integers(end))] ^= np.uint8(1 << int(rng.integers(8)))
        for damaged, dn, dm in ((flipped, n, members), (piece[:-1], n, members),
                                (np.append(piece, np.uint8(0)), n, members), (np.append(piece, np.uint8(1)), n, members),
                                (piece, n + 1, members), (piece, n - 1, members), (piece, n, members - 1)):
            if dn < 1 or dm < 1:
                continue
            e_fast, fast, e_slow, slow = _read_both(damaged.copy(), dn, dm)
            assert e_fast == e_slow, (e_fast, e_slow)
            verdicts.add(e_fast)
            if e_fast == 0:
                assert np.array_equal(fast, slow)
    assert {0, 1, 2, 3} <= verdicts


def test_a_damaged_k_0_piece_is_reported_as_a_rice_error_even_when_later_classes_decode() -> None:
    # The decoder reads a tile's pieces class by class: a bad piece must end the tile there,
    # whatever the later classes' pieces hold (a later good piece must not clear the error).
    old, new = optimizer_step(300_000, torch.bfloat16, seed=11, steps=1)
    a, b = u16(old), u16(new)
    changed, stream, _ = ch.encode_context_huffman(a, b, cc.choose_thresholds(a, torch.bfloat16), CODEC_TILE)
    parsed = ch.ContextHuffmanStream(stream, a.size, CODEC_TILE, changed)
    ntiles, ncls = parsed.ns.shape
    ks = parsed.flat[ntiles * ncls:2 * ntiles * ncls].reshape(ntiles, ncls)
    rice = parsed.flat[2 * ntiles * ncls:3 * ntiles * ncls].reshape(ntiles, ncls)
    offs = parsed.flat[3 * ntiles * ncls + 2 * ntiles:]
    hits = [(t, c) for t in range(ntiles) for c in range(ncls - 1)
            if ks[t, c] == 0 and rice[t, c] > 0 and (rice[t, c + 1:] > 0).any()]
    assert hits, "no tile with a k 0 piece before another piece"
    t, c = hits[0]
    last = int(offs[t] + rice[t, :c + 1].sum()) - 1  # the piece's last byte: its padding's top bit
    damaged = stream.copy()
    damaged[last] |= 0x80
    target = a.copy()
    with pytest.raises(ch.BadStream, match=rf"tile {t} .*Rice"):
        ch.apply_batch_([ch.ContextHuffmanStream(damaged, a.size, CODEC_TILE, changed)], [target])
    assert np.array_equal(target, a)


def test_the_mode_is_refused_before_format_version_3_and_outside_the_compact_encoding() -> None:
    old, new = optimizer_step(20_000, torch.bfloat16, seed=6, steps=1)
    patch = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT, encoding="compact")
    assert read_patch_info(patch.data).tensors[0].mode == "context_huffman"
    for change in ({"format_version": 2}, {"encoding": "baseline"}, {"encoding": "default"}, {"encoding": "context"}):
        with pytest.raises(CorruptData, match="not valid"):
            read_patch_info(with_header(patch.data, lambda h, change=change: h.update(change)))


def test_a_damaged_tile_undoes_every_write_of_the_apply() -> None:
    old, new = optimizer_step(3 * CODEC_TILE, torch.bfloat16, seed=7)
    a, b = u16(old), u16(new)
    changed, stream, _ = ch.encode_context_huffman(a, b, cc.choose_thresholds(a, torch.bfloat16), CODEC_TILE)
    assert stream is not None
    refused = 0
    for at in np.linspace(0.02, 0.99, 40):
        bad = stream.copy()
        bad[int(at * bad.size)] ^= 0x5A
        target = a.copy()
        try:
            ch.ContextHuffmanStream(bad, a.size, CODEC_TILE, changed).apply_(target)
        except ValueError:
            refused += 1
            assert np.array_equal(target, a)
    assert refused >= 10  # a flipped value byte may still decode (the checksum guards those)
    for cut in (1, 10, stream.size // 2):
        with pytest.raises(ValueError):
            ch.ContextHuffmanStream(stream[:-cut].copy(), a.size, CODEC_TILE, changed).apply_(a.copy())


def _pairs_for_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """Edges for the batched coder: tiny and odd sizes, tiles without changes between changed
    ones, one symbol per class (codes of length 0), long codes (past the decoder's first
    lookup), escapes, every element changed."""
    rng = np.random.default_rng(45)
    out = []
    for n in (1, 63, 64, 65, 1000, 2 * CODEC_TILE + 129):
        old, new = optimizer_step(n, torch.bfloat16, seed=n)
        out.append((u16(old).copy(), u16(new).copy()))
    a = u16((torch.randn(4 * CODEC_TILE + 3) * 0.02).to(torch.bfloat16)).copy()
    b = a.copy()
    b[5] += 1  # tile 0 and tile 3 change; tiles 1, 2 and 4 do not
    b[3 * CODEC_TILE + 17:3 * CODEC_TILE + 900:7] += 1  # one symbol in every class
    out.append((a, b))
    a = u16((torch.randn(CODEC_TILE + 11) * 0.02).to(torch.bfloat16)).copy()
    b = a.copy()
    hit = rng.random(a.size) < 0.4
    steps = np.minimum(rng.geometric(0.08, a.size), 64).astype(np.uint16)  # a long tail of rare symbols
    b[hit] += steps[hit]
    b[::301] ^= 0x8000  # escapes
    out.append((a, b))
    a = u16((torch.randn(700) * 0.02).to(torch.bfloat16)).copy()
    out.append((a, a + 1))  # every element changed
    return out


def test_a_batch_gives_each_stream_and_applies_like_one_call_each() -> None:
    pairs = _pairs_for_batches()
    items = [(a, b, cc.choose_thresholds(a, torch.bfloat16)) for a, b in pairs]
    items = [it for it in items if it[2].size]
    batch = ch.encode_context_huffman_batch(items, CODEC_TILE, {})
    streams, targets = [], []
    for (a, b, thr), (changed, stream, guess) in zip(items, batch, strict=True):
        one = ch.encode_context_huffman(a, b, thr, CODEC_TILE)
        assert changed == one[0] == int((a != b).sum()) and guess == one[2]
        assert stream is not None and np.array_equal(stream, one[1])
        parsed = ch.ContextHuffmanStream(stream, a.size, CODEC_TILE, changed)
        pos, diff = parsed.decode(a)
        assert np.array_equal(pos, np.flatnonzero(a != b)) and np.array_equal(a[pos] + diff, b[pos])
        streams.append(parsed)
        targets.append(a.copy())
    undos = ch.apply_batch_(streams, targets)
    for (a, b, _), target in zip(items, targets, strict=True):
        assert np.array_equal(target, b)
    for undo in undos:
        undo()
    for (a, _, _), target in zip(items, targets, strict=True):
        assert np.array_equal(target, a)


def test_a_damaged_stream_in_a_batch_undoes_the_whole_batch() -> None:
    pairs = _pairs_for_batches()[4:7]
    items = [(a, b, cc.choose_thresholds(a, torch.bfloat16)) for a, b in pairs]
    batch = ch.encode_context_huffman_batch(items, CODEC_TILE)
    refused = 0
    for at in np.linspace(0.05, 0.95, 12):
        streams, targets = [], []
        for i, ((a, _, _), (changed, stream, _)) in enumerate(zip(items, batch, strict=True)):
            assert stream is not None
            if i == 1:
                stream = stream.copy()
                stream[int(at * stream.size)] ^= 0x5A
            try:
                streams.append(ch.ContextHuffmanStream(stream, a.size, CODEC_TILE, changed))
            except ValueError:
                break
            targets.append(a.copy())
        if len(streams) < len(items):
            continue
        try:
            ch.apply_batch_(streams, targets)
        except ch.BadStream as exc:
            refused += 1
            assert exc.index == 1
            for (a, _, _), target in zip(items, targets, strict=True):
                assert np.array_equal(target, a)
    assert refused >= 3


def test_encode_patch_batches_keep_the_tensors_order_and_round_trip() -> None:
    pairs = []
    for i, n in enumerate((5000, 3 * CODEC_TILE, 77, 2 * CODEC_TILE + 5)):
        old, new = optimizer_step(n, torch.bfloat16, seed=100 + i, steps=1)
        pairs.append((f"bf{i}", old, new))
        if i == 1:  # another dtype between them closes the batch
            pairs.append(("f32", torch.randn(999), torch.randn(999)))
    pairs.append(("same", pairs[0][1], pairs[0][1].clone()))
    patch = encode_patch(pairs, base_version=1, target_version=2, target_root=ROOT, encoding="compact")
    info = read_patch_info(patch.data)
    assert [t.name for t in info.tensors] == [n for n, _, _ in pairs]
    target = {n: o.clone() for n, o, _ in pairs}
    applied = apply_patch_(target, patch.data)
    assert all(torch.equal(bits_view(target[n]), bits_view(w)) for n, _, w in pairs)
    applied.revert()
    assert all(torch.equal(bits_view(target[n]), bits_view(o)) for n, o, _ in pairs)


def test_compact_parts_stamp_the_version_their_modes_need_and_join_into_the_highest() -> None:
    """A part without a ``context_huffman`` stream stays format 2; the join of the parts is
    format 4 and applies bit for bit."""
    from weftboard.cuda.codec import join_patches

    old, new = optimizer_step(50_000, torch.bfloat16, seed=11, steps=1)
    flat = torch.zeros(50_000, dtype=torch.bfloat16)  # no spread for classes: a huffman stream
    bumped = flat.clone()
    bits_view(bumped)[::97] += 1
    groups = [[("w", old, new)], [("z", flat, bumped)]]
    parts = [encode_patch(g, base_version=1, target_version=2, target_root=ROOT if i else "", encoding="compact").data
             for i, g in enumerate(groups)]
    infos = [read_patch_info(p) for p in parts]
    assert [(i.format_version, i.tensors[0].mode) for i in infos] == [(4, "context_huffman"), (2, "huffman")]
    joined = join_patches(parts)
    assert read_patch_info(joined).format_version == 4
    live = {"w": old.clone(), "z": flat.clone()}
    apply_patch_(live, joined)
    assert torch.equal(bits_view(live["w"]), bits_view(new)) and torch.equal(bits_view(live["z"]), bits_view(bumped))


def test_encode_streams_from_deltas_and_their_targets_write_context_huffman() -> None:
    """The path of a publisher that holds deltas and the tensors they lead to (the sharded
    publisher, a compact finish of a delta-folded tensor): the same stream as the pair's."""
    from weftboard.cuda.codec import assemble_patch, encode_streams
    from weftboard.cuda.diff import diff_tensor

    old, new = optimizer_step(40_000, torch.bfloat16, seed=12, steps=1)
    (enc,) = encode_streams([("w", diff_tensor(old, new))], encoding="compact", targets={"w": new})
    (pair,) = encode_streams([("w", diff_tensor(old, new))], encoding="compact")  # no target: the default's modes
    assert (enc.mode, pair.mode) == ("context_huffman", "huffman") and enc.stream.size < pair.stream.size
    direct = read_patch_info(encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT,
                                          encoding="compact").data).tensors[0]
    assert direct.stream_bytes == enc.stream.size
    data = assemble_patch([enc], base_version=1, target_version=2, target_root=ROOT, encoding="compact").data
    live = {"w": old.clone()}
    apply_patch_(live, data)
    assert torch.equal(bits_view(live["w"]), bits_view(new))


def test_the_packed_and_the_walked_paths_write_and_read_the_same() -> None:
    """Change numbers packed with compress-stores (where the CPU has them) or walked bit by bit:
    the same streams from the encoder, the same changes from the decoder, and the same verdict
    on a damaged stream (with every write undone)."""
    items = [(a, b, cc.choose_thresholds(a, torch.bfloat16)) for a, b in _pairs_for_batches()]
    items = [it for it in items if it[2].size]
    packed = ch.encode_context_huffman_batch(items, CODEC_TILE, {}, vector_compress=True)
    walked = ch.encode_context_huffman_batch(items, CODEC_TILE, {}, vector_compress=False)
    streams = []
    for (a, b, _), (c1, s1, g1), (c2, s2, g2) in zip(items, packed, walked, strict=True):
        assert (c1, g1) == (c2, g2) and s1 is not None and np.array_equal(s1, s2)
        streams.append(ch.ContextHuffmanStream(s1, a.size, CODEC_TILE, c1))
    olds = [a for a, _, _ in items]
    for (o1, d1), (o2, d2) in zip(ch.run_batch(streams, olds, False, vector_compress=True),
                                  ch.run_batch(streams, olds, False, vector_compress=False), strict=True):
        assert np.array_equal(o1, o2) and np.array_equal(d1, d2)
    a, b, _ = items[1]
    verdicts = set()
    for at in np.linspace(0.05, 0.95, 9):
        damaged = streams[1].buf[:streams[1].buf.size].copy()
        damaged[int(at * damaged.size)] ^= 0x21
        try:
            stream = ch.ContextHuffmanStream(damaged, a.size, CODEC_TILE, streams[1].changed)
        except ValueError as exc:
            verdicts.add(str(exc))
            continue
        seen = []
        for vector_compress in (True, False):
            target = a.copy()
            try:
                ch.run_batch([stream], [target], True, vector_compress=vector_compress)
                seen.append(("applied", target.tobytes()))
            except ch.BadStream as exc:
                assert np.array_equal(target, a)
                seen.append(("refused", str(exc)))
        assert seen[0] == seen[1]
        verdicts.add(seen[0][0])
    assert "refused" in verdicts


def test_one_patch_may_hold_streams_coded_with_different_tiles() -> None:
    """Nothing in the format asks every ``context_huffman`` stream of a patch for one tile (a
    patch joined from parts coded apart may mix them): the whole patch applies as each stream
    does alone, in one call per tile size."""
    import xxhash

    g = torch.Generator().manual_seed(5)
    entries, streams, olds, news = [], [], {}, {}
    for name, tile in (("a", 256), ("b", 512), ("c", 256)):
        old = (torch.randn(1024, generator=g) * 0.02).bfloat16()
        new = old.clone()
        new[::7] = (new[::7].float() * 1.01).bfloat16()
        changed, stream, _ = ch.encode_context_huffman(u16(old), u16(new), cc.choose_thresholds(u16(old), old.dtype),
                                                       tile)
        assert stream is not None
        data = bytes(stream)
        entries.append({"name": name, "dtype": "bfloat16", "numel": 1024, "changed": changed,
                        "mode": "context_huffman", "stream_bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data),
                        "tile": tile, "index_bytes": 4})
        streams.append((name, data))
        olds[name], news[name] = old, new
    header = {"format": "weftboard-patch", "format_version": 3, "encoding": "compact", "base_version": 1,
              "target_version": 2, "target_root": "", "tensors": entries}
    target = {n: t.clone() for n, t in olds.items()}
    applied = apply_patch_(target, container.write_container(header, streams))
    assert all(torch.equal(u16_t(target[n]), u16_t(news[n])) for n in news)
    applied.revert()
    assert all(torch.equal(u16_t(target[n]), u16_t(olds[n])) for n in olds)


def u16_t(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("seed", range(6))
def test_value_tables_hold_every_entry_a_decoder_reads(seed: int) -> None:
    """The class tables built from code lengths alone agree with the whole decoder table
    (``huffman.decoder_table`` with each symbol's difference): the first lookup everywhere
    (``LONG`` where a code longer than FAST_BITS begins), the full table wherever a first
    lookup says ``LONG``; skewed, flat and one-symbol codes, with and without escapes."""
    from weftboard.cuda import huffman, tile_decode
    from weftboard.cuda.context_apply import FAST_BITS, LONG, value_tables
    from weftboard.cuda.entropy import ESC, NSYM

    rng = np.random.default_rng(seed)
    for trial in range(40):
        counts = np.zeros(NSYM, np.int64)
        used = rng.choice(NSYM, size=1 if trial % 10 == 0 else int(rng.integers(2, NSYM + 1)), replace=False)
        counts[used] = (rng.pareto(0.6 if trial % 2 else 2.0, used.size) * 50 + 1).astype(np.int64)
        lengths = huffman.code_lengths(counts)
        present = counts > 0
        sym2diff = np.zeros(NSYM, np.uint64)
        for s in range(ESC):
            sym2diff[s] = (65536 - (s // 2 + 1)) if s & 1 else s // 2 + 1
        whole = tile_decode.value_table(huffman.decoder_table(lengths, present), sym2diff)
        full, fast = value_tables(lengths, present)
        short = (whole & 15) <= FAST_BITS
        assert np.array_equal(fast, np.where(short[:1 << FAST_BITS], whole[:1 << FAST_BITS], LONG))
        read_full = np.tile(fast == LONG, (1 << huffman.MAX_BITS) >> FAST_BITS)
        assert np.array_equal(full[read_full], whole[read_full])
        assert lengths.max() <= FAST_BITS or read_full.any()
