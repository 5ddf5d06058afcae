"""The Huffman code of the ``huffman`` stream (``weftboard.cuda.huffman``): optimal and
complete codes within the length limit, tables that round-trip and refuse anything an encoder
could not have written, a bit writer and reader that agree, and whole streams that decode
bitwise, down to the one-symbol code whose value stream is empty."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from patchkit import load_patch_fixture, with_header

from weftboard.cuda import codec, container, decode, huffman, tile_encode
from weftboard.cuda.codec import CODEC_TILE, apply_patch_, decode_stream, encode_patch
from weftboard.cuda.diff import bits_view
from weftboard.cuda.entropy import ESC, NSYM
from weftboard.proto.errors import CorruptData

ROOT = "xxh3-128:" + "00" * 16
counts_st = st.lists(st.integers(0, 10**9), min_size=NSYM, max_size=NSYM).map(lambda c: np.array(c, np.int64))


def _optimal_cost(counts: np.ndarray) -> int:
    """Total bits of an unlimited Huffman code (a textbook heap construction)."""
    live = [int(c) for c in counts if c > 0]
    if len(live) < 2:
        return 0
    heapq.heapify(live)
    cost = 0
    while len(live) > 1:
        merged = heapq.heappop(live) + heapq.heappop(live)
        cost += merged
        heapq.heappush(live, merged)
    return cost


def _kraft(lengths: np.ndarray) -> float:
    return float(sum(2.0 ** -int(d) for d in lengths if d > 0))


@settings(max_examples=200, deadline=None)
@given(counts=counts_st, sparsity=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_code_lengths_are_complete_limited_and_optimal_when_the_limit_allows(counts, sparsity, seed) -> None:
    counts[np.random.default_rng(seed).random(NSYM) < sparsity] = 0
    lengths = huffman.code_lengths(counts)
    used = counts > 0
    assert np.all((lengths > 0) <= used) and lengths.max() <= huffman.MAX_BITS
    if used.sum() == 1:
        assert lengths.sum() == 0  # the one symbol costs no bits
        return
    if used.sum() == 0:
        return
    assert np.all(lengths[used] > 0) and _kraft(lengths) == 1.0
    cost = int((counts * lengths).sum())
    optimal = _optimal_cost(counts)
    assert cost >= optimal
    if cost > optimal:  # only the length limit may cost anything
        assert _unlimited_longest(counts) > huffman.MAX_BITS
    # shorter codes for more frequent symbols
    order = np.argsort(-counts[used], kind="stable")
    assert np.all(np.diff(lengths[used][order]) >= 0)


def _unlimited_longest(counts: np.ndarray) -> int:
    live = [(int(c), i, 0) for i, c in enumerate(counts) if c > 0]
    heapq.heapify(live)
    nxt = len(counts)
    while len(live) > 1:
        a, b = heapq.heappop(live), heapq.heappop(live)
        heapq.heappush(live, (a[0] + b[0], nxt, max(a[2], b[2]) + 1))
        nxt += 1
    return live[0][2]


def test_a_fibonacci_histogram_is_limited_to_max_bits() -> None:
    """Fibonacci counts give the deepest Huffman tree there is: one level per symbol."""
    fib = [1, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])
    counts = np.zeros(NSYM, np.int64)
    counts[:40] = fib
    assert _unlimited_longest(counts) == 39
    lengths = huffman.code_lengths(counts)
    assert lengths.max() == huffman.MAX_BITS and _kraft(lengths) == 1.0
    assert np.all(lengths[:40] > 0)


def test_codes_are_canonical_and_prefix_free() -> None:
    counts = np.zeros(NSYM, np.int64)
    counts[[0, 1, 2, 3, 10, 11, 48, ESC]] = [4000, 3900, 300, 280, 90, 85, 20, 12]
    lengths = huffman.code_lengths(counts)
    codes = huffman.encoder_codes(lengths)
    words = {}
    for s in np.flatnonzero(lengths):
        d = int(codes[s]) >> 32
        assert d == lengths[s]
        rev = int(codes[s]) & 0xFFFFFFFF
        words[int(s)] = format(rev, f"0{d}b")[::-1]  # first bit first
    for s, w in words.items():  # prefix free
        assert not any(o != s and v.startswith(w) for o, v in words.items())
    # canonical: by (length, symbol), each code is the previous one plus one (as integers)
    ordered = sorted(words, key=lambda s: (len(words[s]), s))
    for a, b in zip(ordered, ordered[1:]):
        assert int(words[b], 2) == (int(words[a], 2) + 1) << (len(words[b]) - len(words[a]))


def _table_bytes(lengths: np.ndarray, present: np.ndarray) -> bytes:
    out = np.zeros(huffman.TABLE_BYTES, np.uint8)
    end = huffman.write_table(out, 0, lengths, present)
    return out[:end].tobytes()


def _read(raw: bytes) -> tuple[int, np.ndarray, np.ndarray]:
    lengths = np.zeros(NSYM, np.int64)
    present = np.zeros(NSYM, np.bool_)
    buf = np.frombuffer(raw, np.uint8)
    err, end, _ = huffman.read_table(buf, 0, buf.size, lengths, present)
    return err, lengths, present


@settings(max_examples=100, deadline=None)
@given(counts=counts_st, sparsity=st.floats(0.0, 0.99))
def test_tables_round_trip(counts, sparsity) -> None:
    counts[np.random.default_rng(int(counts.sum()) % 2**32).random(NSYM) < sparsity] = 0
    if not counts.any():
        counts[5] = 1
    lengths = huffman.code_lengths(counts)
    err, got, present = _read(_table_bytes(lengths, counts > 0))
    assert err == 0 and np.array_equal(got, lengths) and np.array_equal(present, counts > 0)


@pytest.mark.parametrize("entries, why", [
    ([(0, 1), (1, 2)], "incomplete: a code word is never used"),
    ([(0, 1), (1, 1), (2, 2)], "over-complete: not a prefix code"),
    ([(1, 1), (0, 1)], "symbols out of order"),
    ([(0, 1), (NSYM, 1)], "an unknown symbol"),
    ([(0, 0), (1, 1)], "a zero length beside other symbols"),
    ([(3, 1)], "one symbol with a non-zero length"),
    ([(0, huffman.MAX_BITS + 1), (1, 1)], "a length over the limit"),
])
def test_tables_an_encoder_could_not_write_are_refused(entries, why) -> None:
    out = bytearray([len(entries)])
    for s, d in entries:
        out += bytes([s]) if s < 128 else bytes([(s & 0x7F) | 0x80, s >> 7])
        out.append(d)
    err, _, _ = _read(bytes(out))
    assert err == 2, why
    assert _read(bytes(out[:-1]))[0] in (1, 2)  # truncated


@settings(max_examples=100, deadline=None)
@given(syms=st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 10, 11, 22, 48, 49, ESC]), min_size=1, max_size=3000),
       skew=st.integers(1, 1000))
def test_the_bit_writer_and_reader_agree(syms, skew) -> None:
    sym = np.array(syms, np.uint8)
    counts = np.bincount(sym, minlength=NSYM).astype(np.int64)
    counts[sym[0]] *= skew
    lengths = huffman.code_lengths(counts)
    codes = huffman.encoder_codes(lengths)
    out = np.full(huffman.tile_bound(sym.size) + 16, 0xEE, np.uint8)  # junk after the stream
    (n,) = huffman.encode_tiles(sym, np.zeros(1, np.int64), np.array([sym.size], np.int64), codes, out, np.zeros(1, np.int64))
    assert n == (int(np.bincount(sym, minlength=NSYM) @ lengths) + 7) // 8
    assert (out[huffman.tile_bound(sym.size):] == 0xEE).all()  # the writer's stores stay in the tile's room
    table = huffman.decoder_table(lengths, counts > 0)
    got, _ = _decode(out, n, sym.size, table)
    assert got.tolist() == sym.tolist()


def _decode(buf: np.ndarray, nbytes: int, count: int, table: np.ndarray) -> tuple[np.ndarray, int]:
    """(symbols, bits used): a plain reading of the stream, for the tests to check against."""
    out = np.empty(count, np.int64)
    hp = 0
    for i in range(count):
        word = int.from_bytes(buf[hp >> 3:(hp >> 3) + 8].tobytes().ljust(8, b"\0"), "little") >> (hp & 7)
        entry = int(table[word & ((1 << huffman.MAX_BITS) - 1)])
        out[i] = entry >> 4
        hp += entry & 15
    assert (hp + 7) // 8 == nbytes
    return out, hp


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def test_a_tensor_of_one_difference_has_empty_value_streams() -> None:
    """Every change +1: the one symbol's code has length 0, each tile's value bytes are none,
    and the stream still decodes and applies bitwise."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2**15, 3 * CODEC_TILE + 11, dtype=np.uint16)
    b = a.copy()
    b[::13] += 1
    changed, stream = tile_encode.encode_huffman(a, b, CODEC_TILE)
    sp = decode.parse_tile_stream({"name": "w", "numel": a.size, "changed": changed, "tile": CODEC_TILE, "mode": "huffman"},
                             stream, 2)
    assert changed == a.size // 13 + 1 and not sp.rans.any()
    assert np.all(sp.slot2sym == 0)  # symbol 0, no bits
    old, new = _bf16(a), _bf16(b)
    patch = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root=ROOT)
    target = {"w": old.clone()}
    apply_patch_(target, patch.data)
    assert torch.equal(bits_view(target["w"]), bits_view(new))


def _huffman_entry_and_stream(seed: int = 3) -> tuple[dict, bytes]:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2**15, 2 * CODEC_TILE, dtype=np.uint16)
    b = a.copy()
    pick = rng.random(a.size) < 0.05
    b[pick] += rng.choice(np.array([1, 65535, 2, 65534, 7, 300], np.uint16), int(pick.sum()))
    patch = encode_patch([("w", _bf16(a), _bf16(b))], base_version=1, target_version=2, target_root=ROOT)
    c = container.read_container(patch.data)
    (entry,) = c.entries
    assert entry["mode"] == "huffman"
    return entry, bytes(c.streams["w"])


def test_a_set_padding_bit_after_the_values_is_refused() -> None:
    entry, stream = _huffman_entry_and_stream()
    buf = np.frombuffer(stream, np.uint8)
    sp = decode.parse_tile_stream(entry, buf, 2)
    assert decode_stream(entry, stream).positions.size == entry["changed"]
    padded = 0
    for t in range(sp.ns.size):
        at = sp.offs[t] + sp.rice[t]  # the tile's value bytes
        _, used = _decode(buf[at:], int(sp.rans[t]), int(sp.ns[t]), sp.slot2sym)
        if used % 8 == 0:
            continue
        padded += 1
        raw = bytearray(stream)
        raw[at + sp.rans[t] - 1] ^= 1 << (used % 8)  # the first padding bit
        with pytest.raises(CorruptData, match="value stream"):
            decode_stream(entry, bytes(raw))
    assert padded


def test_a_value_stream_one_byte_longer_than_its_bits_is_refused() -> None:
    """The directory says one value byte more than the codes use (the stream rebuilt to fit):
    the tile does not end where recorded."""
    entry, stream = _huffman_entry_and_stream(seed=4)
    buf = np.frombuffer(stream, np.uint8)
    sp = decode.parse_tile_stream(entry, buf, 2)
    assert sp.rans[0] > 0
    # rebuild: table | directory with tile 0's value length + 1 | payloads with a zero byte inserted
    from weftboard.cuda.entropy import write_varint

    table_end = _table_end(buf)
    out = np.zeros(buf.size + 64, np.uint8)
    out[:table_end] = buf[:table_end]
    p = table_end
    for t in range(sp.ns.size):
        p = write_varint(out, p, int(sp.ns[t]))
        if sp.ns[t]:
            out[p] = sp.ks[t]
            p = write_varint(out, p + 1, int(sp.rice[t]))
            p = write_varint(out, p, int(sp.rans[t]) + (t == 0))
            p = write_varint(out, p, int(sp.esc[t]))
    for t in range(sp.ns.size):
        o = sp.offs[t]
        piece = buf[o:sp.offs[t + 1]]
        cut = sp.rice[t] + sp.rans[t]
        piece = np.concatenate([piece[:cut], np.zeros(int(t == 0), np.uint8), piece[cut:]])
        out[p:p + piece.size] = piece
        p += piece.size
    rebuilt = dict(entry, stream_bytes=p)
    with pytest.raises(CorruptData, match="value stream"):
        decode_stream(rebuilt, out[:p].tobytes())


def _table_end(buf: np.ndarray) -> int:
    lengths = np.zeros(NSYM, np.int64)
    present = np.zeros(NSYM, np.bool_)
    err, end, _ = huffman.read_table(buf, 0, buf.size, lengths, present)
    assert err == 0
    return end


def test_a_version_1_header_cannot_name_the_huffman_mode() -> None:
    """Format 1 had no Huffman streams: a header that says 1 and huffman is refused, while a
    format 1 patch of rANS ``sparse`` streams still applies."""

    def rewrite(data: bytes, **changes) -> bytes:
        return with_header(data, lambda header: header.update(changes))

    rng = np.random.default_rng(9)
    a = rng.integers(0, 2**15, CODEC_TILE, dtype=np.uint16)
    b = a.copy()
    b[::7] += 1
    huff = encode_patch([("w", _bf16(a), _bf16(b))], base_version=1, target_version=2, target_root=ROOT).data
    with pytest.raises(CorruptData, match="not valid"):
        codec.read_patch_info(rewrite(huff, format_version=1))
    # a format 1 patch of rANS ``sparse`` streams (a committed fixture: the writer was retired)
    v1 = load_patch_fixture("bf16_small_tiles")
    assert codec.read_patch_info(v1.data).format_version == 1
    target = v1.tensors("base")
    apply_patch_(target, v1.data)
    for name, want in v1.tensors("expected").items():
        assert torch.equal(bits_view(target[name]), bits_view(want)), name
    with pytest.raises(CorruptData, match="format_version 5 is not supported"):
        codec.read_patch_info(rewrite(huff, format_version=5))


@pytest.mark.parametrize("count", [4000, 4001, 4002, 4003])
def test_groups_of_the_longest_codes_are_written_whole(count: int) -> None:
    """Four codes of MAX_BITS go in one append (48 bits on top of up to 7 pending): a run of
    the rarest symbols, in each tail length, reads back and stays inside the tile's room."""
    counts = np.zeros(NSYM, np.int64)
    counts[:20] = 1 << np.arange(20, 0, -1)  # lengths 1, 2, 3, ... limited to MAX_BITS
    lengths = huffman.code_lengths(counts)
    assert lengths.max() == huffman.MAX_BITS
    rare = np.flatnonzero(lengths == huffman.MAX_BITS).astype(np.uint8)
    rng = np.random.default_rng(count)
    sym = rng.choice(rare, count)
    sym[::7] = 0  # a one-bit code now and then, so the groups start at every bit offset
    out = np.full(huffman.tile_bound(count) + 16, 0xEE, np.uint8)
    (n,) = huffman.encode_tiles(sym, np.zeros(1, np.int64), np.array([count], np.int64),
                                huffman.encoder_codes(lengths), out, np.zeros(1, np.int64))
    assert n == (int(lengths[sym.astype(np.int64)].sum()) + 7) // 8
    assert (out[huffman.tile_bound(count):] == 0xEE).all()
    got, _ = _decode(out, n, count, huffman.decoder_table(lengths, counts > 0))
    assert got.tolist() == sym.tolist()
