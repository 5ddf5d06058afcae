"""Hand-built hostile patches: what byte mutations of real patches do not reach.

A random mutation almost never writes a 9-byte varint, so the fuzzers of test_codec_fuzz.py
never gave the tile directory lengths near 2**63. Such lengths, summed in int64, wrapped
negative, passed the "past the stream's end" check and sent the decoders' reads 2**63 bytes
before the stream: a segfault in every decode path. Per-class change counts near 2**63 wrapped
the same way to a small total and sent the ``context`` decoder's writes past its output. The cases run in a child process
(``python tests/test_codec_crafted.py``, one verdict a line as each case ends), so a
regression fails the case it crashed in, with the signal, instead of ending the test run.

Also: headers nested past the JSON parser's stack, and a revert after the bytes a patch was
applied from changed under it (a part whose range a retried download wrote again).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weftboard.cuda import container as patch_container
from weftboard.cuda.codec import (
    apply_patch_,
    apply_patch_arriving_,
    decode_stream,
    encode_patch,
    read_patch_info,
)
from weftboard.cuda.diff import bits_view, unsigned_np
from weftboard.proto.errors import CorruptData, InvalidArgument

BIG = 2**63 - 1


def varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def container(stream: bytes, *, numel: int, changed: int, mode: str, dtype: str = "bfloat16", tile: int = 256,
              encoding: str = "default") -> bytes:
    """One tensor's ``stream`` in a container whose every checksum holds."""
    entry = {"name": "t", "dtype": dtype, "numel": numel, "changed": changed, "mode": mode,
             "stream_bytes": len(stream), "xxh3_64": xxhash.xxh3_64_hexdigest(stream), "tile": tile,
             "index_bytes": 4}
    header = {"format": "weftboard-patch", "format_version": 2, "encoding": encoding, "base_version": 1,
              "target_version": 2, "target_root": "", "tensors": [entry]}
    return patch_container.write_container(header, [("t", stream)])


def huffman_table(lengths: list[tuple[int, int]]) -> bytes:
    return varint(len(lengths)) + b"".join(varint(s) + bytes([n]) for s, n in lengths)


def rans_table(freqs: list[tuple[int, int]]) -> bytes:
    return varint(len(freqs)) + b"".join(varint(s) + varint(f) for s, f in freqs)


def tile_entry(n: int, k: int, rice: int, values: int, escapes: int) -> bytes:
    """One tile's directory entry of a one-class stream."""
    return varint(n) + bytes([k]) + varint(rice) + varint(values) + varint(escapes) if n else varint(0)


def _huffman(dtype: str, width: int) -> tuple[bytes, dict]:
    # two tiles whose Rice lengths wrap the offsets' sum back onto the stream's end
    stream = huffman_table([(0, 1), (128, 1)]) + tile_entry(1, 0, BIG, 8, 1) + tile_entry(1, 0, BIG, 6, 1)
    return container(stream + b"\xff" * 16, numel=512, changed=2, mode="huffman", dtype=dtype), {"dtype": dtype}


CASES = {
    "sparse": lambda: (container(rans_table([(0, 16384)]) + tile_entry(1, 0, BIG, BIG, 1) + b"\xff" * 8,
                                 numel=256, changed=1, mode="sparse"), {}),
    "huffman": lambda: _huffman("bfloat16", 2),
    "huffman-fp8": lambda: _huffman("float8_e4m3fn", 1),
    "huffman-uint8": lambda: _huffman("uint8", 1),
    "context": lambda: (container(
        varint(1) + varint(0x3F80) + rans_table([(0, 16384)]) * 2 + varint(1) + varint(1)
        + bytes([0]) + varint(BIG) + bytes([0]) + varint(2**62 + 1) + varint(2**62) + varint(0),
        numel=256, changed=2, mode="context", encoding="context"), {}),
    # three classes whose change counts (2**63 - 1, 2**63 - 1, 3) summed wrap to the one change
    # the entry names: class 0 then decoded about 256 changes into a one-change output
    "context-counts": lambda: (container(
        varint(2) + varint(0x80) + varint(0x100) + (varint(1) + varint(0) + varint(16384)) * 3
        + varint(BIG) + varint(BIG) + varint(3) + bytes([0]) + varint(32) + bytes([0]) + varint(0) + bytes([0])
        + varint(0) + varint(4) + varint(0) + bytes(32) + (1 << 23).to_bytes(4, "little"),
        numel=256, changed=1, mode="context", encoding="context"), {}),
}
READERS = ("apply", "arriving", "decode")


def run_case(name: str, reader: str) -> str:
    """What reading case ``name`` through ``reader`` raised: its exception's class name."""
    data, kw = CASES[name]()
    dtype = getattr(torch, kw.get("dtype", "bfloat16"))
    tensors = {"t": torch.zeros(512 if name.startswith("huffman") else 256, dtype=dtype)}
    try:
        if reader == "apply":
            apply_patch_(tensors, data)
        elif reader == "arriving":
            from weftboard.subscriber.arriving import ArrivingBytes

            blob = ArrivingBytes(len(data))
            blob.put(0, data)
            apply_patch_arriving_(tensors, [blob], timeout_s=5)
        else:
            c = patch_container.read_container(data)
            base = unsigned_np(bits_view(tensors["t"])) if name.startswith("context") else None
            decode_stream(c.entries[0], c.streams["t"], base)
    except Exception as exc:  # noqa: BLE001 - the class is the verdict
        if not (tensors["t"].view(torch.uint8) == 0).all():
            return "written"
        return type(exc).__name__
    return "accepted"


@pytest.fixture(scope="module")
def verdicts() -> tuple[dict[tuple[str, str], str], subprocess.CompletedProcess]:
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=900)
    seen = {}
    for line in proc.stdout.splitlines():
        name, reader, verdict = line.split()
        seen[name, reader] = verdict
    return seen, proc


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_directory_lengths_that_would_wrap_are_refused(verdicts, name: str, reader: str) -> None:
    seen, proc = verdicts
    assert (name, reader) in seen, (f"the child process ended (exit {proc.returncode}; a negative one is a "
                                    f"signal) before this case finished: {proc.stderr[-2000:]}")
    assert seen[name, reader] == "CorruptData"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.sampled_from([0, 1, 7, 64, 2**31, 2**32 + 5, 2**62, 2**62 + 1, BIG - 1, BIG]),
                        min_size=6, max_size=6),
       ns=st.tuples(st.integers(0, 3), st.integers(0, 3)), payload=st.binary(min_size=0, max_size=64))
def test_any_directory_lengths_are_refused_or_stay_inside_the_stream(lengths, ns, payload) -> None:
    """Two tiles with lengths drawn from the edges of int64: refused, or decoded in bounds."""
    stream = huffman_table([(0, 1), (128, 1)])
    for t in range(2):
        rice, values, esc = lengths[3 * t: 3 * t + 3]
        stream += tile_entry(ns[t], 0, rice, values, min(esc, ns[t]))
    n = sum(ns)
    data = container(stream + payload, numel=512, changed=n, mode="huffman")
    target = {"t": torch.zeros(512, dtype=torch.bfloat16)}
    try:
        apply_patch_(target, data)
    except CorruptData:
        assert (target["t"].view(torch.int16) == 0).all()  # nothing left written
        return
    assert int((target["t"].view(torch.int16) != 0).sum()) <= n


@pytest.mark.parametrize("where", ["outer", "inner"])
def test_a_header_nested_past_the_parsers_stack_is_corrupt_data(where: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    if where == "outer":
        blob = deep.encode()
    else:
        meta = {"weftboard": deep, "weftboard_xxh3_64": xxhash.xxh3_64_hexdigest(deep.encode())}
        blob = json.dumps({"__metadata__": meta}).encode()
    with pytest.raises(CorruptData, match="not a weftboard-patch"):
        apply_patch_({}, struct.pack("<Q", len(blob)) + blob)


def _a_patch() -> tuple[torch.Tensor, torch.Tensor, bytes]:
    g = torch.Generator().manual_seed(3)
    old = (torch.randn(4096, generator=g) * 0.02).bfloat16()
    new = old.clone()
    bits = new.view(torch.int16)
    mask = torch.rand(4096, generator=g) < 0.1
    bits[mask] += 1
    bits[:40] ^= 0x4000  # escapes: values far from the old ones
    data = encode_patch([("t", old, new)], base_version=1, target_version=2, target_root="").data
    assert patch_container.read_container(data).entries[0]["mode"] == "huffman"
    return old, new, data


def test_a_revert_restores_the_old_bytes_after_the_patch_bytes_changed() -> None:
    """``revert`` decodes the stream again: from the bytes hashed at apply time, not from a
    buffer the caller (or a retried download) has written since."""
    old, new, data = _a_patch()
    buf = bytearray(data)
    target = {"t": old.clone()}
    applied = apply_patch_(target, buf)
    assert torch.equal(target["t"].view(torch.int16), new.view(torch.int16))
    rng = np.random.default_rng(0)
    buf[len(buf) - 600:] = rng.integers(0, 256, 600, dtype=np.uint8).tobytes()  # the stream's tail, rewritten
    applied.revert()
    assert torch.equal(target["t"].view(torch.int16), old.view(torch.int16))


def test_an_arriving_part_rewritten_after_its_apply_reverts_exactly() -> None:
    from weftboard.subscriber.arriving import ArrivingBytes

    old, new, data = _a_patch()
    blob = ArrivingBytes(len(data))
    blob.put(0, data)
    target = {"t": old.clone()}
    applied = apply_patch_arriving_(target, [blob], timeout_s=5)
    assert torch.equal(target["t"].view(torch.int16), new.view(torch.int16))
    blob.put(len(data) - 600, bytes(600))  # a retried range brought other bytes; the blob's digest will fail
    applied.revert()
    assert torch.equal(target["t"].view(torch.int16), old.view(torch.int16))


if __name__ == "__main__":
    for case in sorted(CASES):
        for how in READERS:
            print(case, how, run_case(case, how), flush=True)


@pytest.mark.parametrize("base,target", [(-1, 0), (5, 5), (3, 2), (1, 1 << 63)])
def test_a_header_whose_versions_do_not_go_forward_is_refused(base: int, target: int) -> None:
    header = {"format": "weftboard-patch", "format_version": 2, "encoding": "default", "base_version": base,
              "target_version": target, "target_root": "", "tensors": [
                  {"name": "t", "dtype": "bfloat16", "numel": 4, "changed": 0, "mode": "empty", "stream_bytes": 0,
                   "xxh3_64": xxhash.xxh3_64_hexdigest(b""), "tile": 256, "index_bytes": 4}]}
    data = patch_container.write_container(header, [("t", b"")])
    with pytest.raises(CorruptData, match="base_version"):
        read_patch_info(data)
    with pytest.raises(InvalidArgument, match="later one"):
        encode_patch([("t", torch.zeros(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16))],
                     base_version=base, target_version=target, target_root="")


def test_a_header_with_elements_wider_than_the_streams_code_is_refused_as_corrupt() -> None:
    data = container(b"", numel=4, changed=0, mode="empty", dtype="complex128")
    with pytest.raises(CorruptData, match="16 bytes an element"):
        read_patch_info(data)
    with pytest.raises(CorruptData, match="16 bytes an element"):
        apply_patch_({"t": torch.zeros(4, dtype=torch.complex128)}, data)
