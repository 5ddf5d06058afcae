"""Property-based fuzzing (hypothesis) of every decoder and of the encoder.

Properties:
- any (old, new) pair of any dtype round-trips bit for bit, in every encoding;
- a mutated or truncated patch either raises CorruptData or applies to exactly the intended
  result (a mutation can only be harmless, e.g. in JSON padding), and never crashes or hangs;
- each stream decoder, fed mutated streams with the checksums bypassed, raises CorruptData or
  returns well-formed output (ascending positions below numel, the declared count);
- the fused decode+apply kernel refuses exactly what the two-step decoder refuses, undoing its
  writes, and otherwise writes exactly the two-step decoder's result;
- the context decoder, fed mutated streams, raises CorruptData having written nothing, or
  decodes the declared number of distinct in-range positions and applies exactly them.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from patchkit import load_patch_fixture, with_header

from weftboard.cuda import codec, container, decode
from weftboard.cuda.codec import (
    apply_patch_,
    decode_stream,
    encode_patch,
    read_patch_info,
)
from weftboard.cuda.diff import bits_view
from weftboard.proto.errors import CorruptData

ROOT = "xxh3-128:" + "00" * 16
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.float64]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def tensor_pairs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    width = torch.empty(0, dtype=dtype).element_size()
    n = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = old.copy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])
    style = draw(st.sampled_from(["ulp", "random", "dense", "runs", "none"]))
    if n and style != "none":
        density = draw(st.floats(0.0, 1.0))
        mask = rng.random(n) < density
        if style == "runs":
            mask[:] = False
            start = rng.integers(0, n)
            mask[start : start + rng.integers(1, 200)] = True
        if style in ("ulp", "runs"):
            new[mask] += rng.choice(np.array([1, 2, 3, 64, 65], dtype=new.dtype), int(mask.sum()))
            new[mask & (rng.random(n) < 0.5)] -= 2
        else:
            new[mask] = rng.integers(0, 256, int(mask.sum()) * width, dtype=np.uint8).view(new.dtype)
    if n == 0:
        return torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)
    o = torch.from_numpy(old).view(dtype)
    w = torch.from_numpy(new.view(np.uint8).copy()).view(dtype)
    return o, w


@FUZZ
@given(pair=tensor_pairs(), encoding=st.sampled_from(["default", "baseline", "context", "compact"]))
def test_any_pair_round_trips(pair, encoding) -> None:
    old, new = pair
    patch = encode_patch([("t", old, new)], base_version=1, target_version=2, target_root=ROOT, encoding=encoding)
    target = {"t": old.clone()}
    applied = apply_patch_(target, patch.data)
    assert torch.equal(bits_view(target["t"]), bits_view(new))
    assert applied.changed["t"] == int((bits_view(old) != bits_view(new)).sum())
    applied.revert()
    assert torch.equal(bits_view(target["t"]), bits_view(old))


def _sample_patch(encoding: str):
    rng = np.random.default_rng(1)
    if encoding == "compact":  # an optimizer-like step, which the context_huffman stream pays off on
        master = torch.from_numpy(rng.standard_normal(70_000, dtype=np.float32)) * 0.02
        old = master.to(torch.bfloat16)
        new = (master + 1e-5 * torch.from_numpy(np.sign(rng.standard_normal(70_000, dtype=np.float32)))).to(torch.bfloat16)
    else:
        old = torch.from_numpy(rng.integers(0, 2**16, 70_000, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
        new = old.clone()
        b = bits_view(new)
        idx = torch.from_numpy(np.sort(rng.choice(70_000, 900, replace=False)))
        b[idx] += torch.from_numpy(rng.choice(np.array([1, -1, 2, 300], dtype=np.int16), 900))
    small_old = torch.arange(40, dtype=torch.uint8)
    small_new = small_old.flip(0).contiguous()
    pairs = [("w", old, new), ("s", small_old, small_new)]
    patch = encode_patch(pairs, base_version=1, target_version=2, target_root=ROOT, encoding=encoding)
    return patch, {n: o for n, o, _ in pairs}, {n: w for n, _, w in pairs}


PATCHES = {enc: _sample_patch(enc) for enc in ("default", "baseline", "context", "compact")}


def test_the_compact_sample_holds_a_context_huffman_stream() -> None:
    """So the fuzzers below reach the ``context_huffman`` decoder."""
    assert read_patch_info(PATCHES["compact"][0].data).tensors[0].mode == "context_huffman"


@st.composite
def mutations(draw, size: int):
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite"]))
    pos = draw(st.integers(0, size - 1))
    value = draw(st.integers(1, 255))
    return kind, pos, value


def _mutate(data: bytes, m) -> bytes:
    kind, pos, value = m
    if kind == "flip":
        return data[:pos] + bytes([data[pos] ^ value]) + data[pos + 1 :]
    if kind == "truncate":
        return data[:pos]
    if kind == "insert":
        return data[:pos] + bytes([value]) + data[pos:]
    return data[:pos] + bytes([value]) * 16 + data[pos + 16 :]


@FUZZ
@given(encoding=st.sampled_from(["default", "baseline", "context", "compact"]), m=st.data())
def test_mutated_patch_is_rejected_or_harmless(encoding, m) -> None:
    patch, olds, news = PATCHES[encoding]
    mutation = m.draw(mutations(len(patch.data)))
    data = _mutate(patch.data, mutation)
    target = {n: t.clone() for n, t in olds.items()}
    try:
        applied = apply_patch_(target, data)
    except CorruptData:
        assert all(torch.equal(bits_view(target[n]), bits_view(olds[n])) for n in olds), "a refused patch wrote"
        return
    assert all(torch.equal(bits_view(target[n]), bits_view(news[n])) for n in news), "silently wrong apply"
    assert read_patch_info(data) == read_patch_info(patch.data)
    assert applied.target_version == 2


def _parts_of(encoding: str) -> tuple[list[bytes], dict, dict]:
    """The sample patch of ``encoding`` cut into two parts (tensors alternating)."""
    _, olds, news = PATCHES[encoding]
    names = list(olds)
    groups = [names[0::2], names[1::2]]
    parts = [encode_patch([(n, olds[n], news[n]) for n in g], base_version=1, target_version=2,
                          target_root="" if i == 0 else ROOT, encoding=encoding).data for i, g in enumerate(groups)]
    return parts, olds, news


PARTS = {enc: _parts_of(enc) for enc in ("default", "context", "compact")}


@FUZZ
@given(encoding=st.sampled_from(["default", "context", "compact"]), which=st.integers(0, 1), m=st.data())
def test_a_mutated_part_is_rejected_or_harmless_joined_or_arriving(encoding, which, m) -> None:
    """Both readers of a patch in parts (the arriving apply and ``join_patches``) refuse a damaged
    part without writing anything, or give the exact result."""
    from weftboard.subscriber.arriving import ArrivingBytes

    parts, olds, news = PARTS[encoding]
    parts = list(parts)
    parts[which] = _mutate(parts[which], m.draw(mutations(len(parts[which]))))
    for reader in ("arriving", "joined"):
        target = {n: t.clone() for n, t in olds.items()}
        try:
            if reader == "joined":
                apply_patch_(target, codec.join_patches(parts))
            else:
                blobs = [ArrivingBytes(len(d)) for d in parts]
                for b, d in zip(blobs, parts):
                    if d:
                        b.put(0, d)
                    b.verified()
                codec.apply_patch_arriving_(target, blobs, timeout_s=5)
        except CorruptData:
            assert all(torch.equal(bits_view(target[n]), bits_view(olds[n])) for n in olds), f"a refused {reader} apply wrote"
            continue
        assert all(torch.equal(bits_view(target[n]), bits_view(news[n])) for n in news), f"silently wrong {reader} apply"


def _entries_and_streams(patch_data: bytes):
    c = container.read_container(patch_data)
    return [(e, bytes(c.streams[e["name"]])) for e in c.entries if e["mode"] != "empty"]


def _stream_cases():
    rng = np.random.default_rng(2)
    cases = []
    for dtype, n, density in [(torch.bfloat16, 140_000, 0.01), (torch.float8_e4m3fn, 5000, 0.3), (torch.float32, 3000, 0.7), (torch.float16, 50_000, 0.5), (torch.uint8, 100, 1.0)]:
        w = torch.empty(0, dtype=dtype).element_size()
        old = torch.from_numpy(rng.integers(0, 256, n * w, dtype=np.uint8)).view(dtype)
        new = old.clone()
        b = bits_view(new)
        mask = torch.from_numpy(rng.random(n) < density)
        b[mask] = (b[mask].to(torch.int64) + 1).to(b.dtype) if b.dtype != torch.uint8 else b[mask] ^ 1
        if dtype != torch.float16:
            b[: n // 50] ^= 0x11  # some escapes
        else:  # half the elements replaced by random bits: the bitmap mode
            b[mask] = torch.from_numpy(rng.integers(-(2**15), 2**15, int(mask.sum()), dtype=np.int16))
        for enc in ("default", "baseline"):
            p = encode_patch([("x", old, new)], base_version=1, target_version=2, target_root=ROOT, encoding=enc)
            ((entry, stream),) = _entries_and_streams(p.data)
            cases.append((entry, stream))
    # format 1's rANS ``sparse`` streams, from committed fixtures (their writer was retired)
    for fixture, name in [("bf16_tiles", "w"), ("u8_fp8", "q"), ("f32_i32", "f"), ("i64_f64", "l")]:
        fx = load_patch_fixture(fixture)
        assert fx.entries[name]["mode"] == "sparse"
        cases.append((fx.entries[name], fx.stream(name)))
    return cases


STREAMS = _stream_cases()


def test_stream_cases_cover_every_mode() -> None:
    assert {e["mode"] for e, _ in STREAMS} == {"huffman", "sparse", "bitmap", "all", "baseline"}


@FUZZ
@given(i=st.integers(0, len(STREAMS) - 1), m=st.data())
def test_stream_decoders_reject_or_stay_well_formed(i, m) -> None:
    entry, stream = STREAMS[i]
    for _ in range(m.draw(st.integers(1, 3))):
        if not stream:
            break
        stream = _mutate(stream, m.draw(mutations(len(stream))))
    try:
        dec = decode_stream(entry, stream)
    except CorruptData as exc:
        assert str(exc)
        return
    pos = dec.positions
    assert pos.dtype == np.int64 and pos.size == entry["changed"] == dec.values.size
    if pos.size:
        assert pos[0] >= 0 and pos[-1] < entry["numel"] and np.all(np.diff(pos) > 0)


@FUZZ
@given(raw=st.binary(max_size=400), i=st.integers(0, len(STREAMS) - 1))
def test_stream_decoders_on_random_bytes(raw, i) -> None:
    entry, _ = STREAMS[i]
    try:
        dec = decode_stream(entry, raw)
    except CorruptData:
        return
    assert dec.positions.size == entry["changed"]


@FUZZ
@given(raw=st.binary(max_size=600))
def test_container_reader_on_random_bytes(raw) -> None:
    for data in (raw, struct.pack("<Q", len(raw)) + raw):
        with pytest.raises(CorruptData):
            read_patch_info(data)
        with pytest.raises(CorruptData):
            apply_patch_({}, data)


def _with_first_entry_field(data: bytes, field: str, value) -> bytes:
    """``data`` with the first tensor entry's ``field`` set to ``value`` (checksum consistent)."""
    return with_header(data, lambda header: header["tensors"][0].__setitem__(field, value))


@FUZZ
@given(field=st.sampled_from(["numel", "changed", "tile", "stream_bytes", "mode", "dtype", "index_bytes", "name"]),
       value=st.one_of(st.integers(-5, 2**40), st.text(max_size=8), st.none(), st.booleans()))
def test_header_fields_are_validated(field, value) -> None:
    """A header rewritten with a consistent checksum but a wrong field is still refused."""
    patch, olds, news = PATCHES["default"]
    (hlen,) = struct.unpack("<Q", patch.data[:8])
    first = json.loads(json.loads(patch.data[8 : 8 + hlen])["__metadata__"]["weftboard"])["tensors"][0]
    if first.get(field) == value and type(first.get(field)) is type(value):
        return
    data = _with_first_entry_field(patch.data, field, value)
    target = {n: t.clone() for n, t in olds.items()}
    with pytest.raises(CorruptData):
        apply_patch_(target, data)
    assert all(torch.equal(bits_view(target[n]), bits_view(olds[n])) for n in olds)


@pytest.mark.parametrize("field, value, kind", [("name", 7, "str"), ("numel", True, "int"), ("changed", "3", "int"),
                                                 ("tile", 65536.0, "int"), ("xxh3_64", None, "str"),
                                                 ("index_bytes", False, "int")])
def test_a_header_field_of_the_wrong_type_is_named(field, value, kind) -> None:
    """The entries' types are checked in one comparison on the common path; a field of the
    wrong type (a bool where an int belongs too) still gets its own message."""
    patch, olds, _ = PATCHES["default"]
    data = _with_first_entry_field(patch.data, field, value)
    where = "tensor #0" if field == "name" else "tensor "
    with pytest.raises(CorruptData, match=f"{where}.*field '{field}' is missing or not a {kind}"):
        read_patch_info(data)


SPARSE = [i for i, (e, _) in enumerate(STREAMS) if e["mode"] in ("huffman", "sparse")]


@FUZZ
@given(i=st.sampled_from(SPARSE), m=st.data(), seed=st.integers(0, 2**31 - 1))
def test_fused_apply_agrees_with_the_two_step_decoder_or_undoes_itself(i, m, seed) -> None:
    """The fused decode+apply kernel, fed mutated streams with the checksum bypassed, refuses
    exactly what the two-step decoder refuses, leaves the target untouched when it does, and
    otherwise writes exactly the two-step decoder's result."""
    entry, stream = STREAMS[i]
    for _ in range(m.draw(st.integers(1, 3))):
        if not stream:
            break
        stream = _mutate(stream, m.draw(mutations(len(stream))))
    dtype = getattr(torch, entry["dtype"])
    width = torch.empty(0, dtype=dtype).element_size()
    rng = np.random.default_rng(seed)
    before = torch.from_numpy(rng.integers(0, 256, entry["numel"] * width, dtype=np.uint8)).view(dtype)
    target = before.clone()
    try:
        sp = decode.parse_tile_stream(entry, np.frombuffer(stream, dtype=np.uint8), width)
        decode.apply_tile_stream_(target, entry, sp, 1)
    except CorruptData:
        assert torch.equal(bits_view(target), bits_view(before)), "a refused stream left writes behind"
        with pytest.raises(CorruptData):
            decode_stream(entry, stream)
        return
    dec = decode_stream(entry, stream)
    expected = before.clone()
    eb = bits_view(expected)
    pos = torch.from_numpy(dec.positions)
    diff = torch.from_numpy(dec.values.astype(np.int64) if width < 8 else dec.values.view(np.int64))
    eb[pos] = (eb[pos].to(torch.int64) + diff).to(eb.dtype)
    assert torch.equal(bits_view(target), eb)


def _context_case():
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(150_000, generator=gen) * 0.02
    old = master.to(torch.bfloat16)
    new = (master + 2e-4 * torch.randn(150_000, generator=gen)).to(torch.bfloat16)
    bits_view(new)[:40] ^= 0x4321  # some escapes
    patch = encode_patch([("x", old, new)], base_version=1, target_version=2, target_root=ROOT, encoding="context")
    (entry, stream), = _entries_and_streams(patch.data)
    assert entry["mode"] == "context"
    return entry, stream, old


CONTEXT = _context_case()


@FUZZ
@given(m=st.data())
def test_context_decoder_rejects_or_stays_well_formed(m) -> None:
    entry, stream, old = CONTEXT
    for _ in range(m.draw(st.integers(1, 3))):
        if not stream:
            break
        stream = _mutate(stream, m.draw(mutations(len(stream))))
    base = bits_view(old).numpy().view(np.uint16)
    dec = None
    try:
        dec = decode_stream(entry, stream, base)
    except CorruptData as exc:
        assert str(exc)
    else:
        pos = dec.positions
        assert pos.size == entry["changed"] == dec.values.size
        assert np.unique(pos).size == pos.size and (pos.size == 0 or (pos.min() >= 0 and pos.max() < entry["numel"]))
    target = old.clone()
    try:
        step = decode.parse_context_stream(entry, np.frombuffer(stream, np.uint8))
        undo = step.apply_(bits_view(target).numpy().view(np.uint16))
    except (CorruptData, ValueError):
        assert dec is None, "the in-place apply refused what the decoder accepted"
        assert torch.equal(bits_view(target), bits_view(old)), "a refused context stream wrote"
        return
    assert dec is not None, "the in-place apply accepted what the decoder refused"
    expected = base.copy()
    expected[dec.positions] += dec.values
    assert np.array_equal(bits_view(target).numpy().view(np.uint16), expected)
    undo()
    assert torch.equal(bits_view(target), bits_view(old))
