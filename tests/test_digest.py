"""Digests of served bytes: exact bytes, any dtype, chunked device path, canonical root."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xxhash

from weftboard.cuda import digest as dg
from weftboard.cuda.digest import root_digest, root_encoding, tensor_digest


def _expected(raw: bytes) -> str:
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(raw)


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(-50, 50, dtype=torch.int16),
        torch.randn(7, 13).to(torch.bfloat16),
        torch.randn(33).to(torch.float8_e4m3fn),
        torch.randint(0, 256, (5, 4), dtype=torch.uint8),
        torch.randn(3, 3, dtype=torch.float64),
        torch.tensor(1.5),
        torch.empty(0, 4),
    ],
    ids=["int16", "bf16", "fp8", "uint8", "fp64", "scalar", "empty"],
)
def test_tensor_digest_hashes_the_stored_bytes(t: torch.Tensor) -> None:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    assert tensor_digest(t) == _expected(raw)


def test_digest_follows_c_order_not_storage() -> None:
    base = torch.randn(6, 9).to(torch.bfloat16)
    transposed = base.t()
    assert not transposed.is_contiguous()
    assert tensor_digest(transposed) == tensor_digest(transposed.contiguous())
    assert tensor_digest(transposed) != tensor_digest(base)


def test_digest_sees_bits_floats_hide() -> None:
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[1] += 1
    assert tensor_digest(a) != tensor_digest(b)


def test_chunked_device_path_equals_one_shot(monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.randint(0, 256, (10_007,), dtype=torch.uint8)
    monkeypatch.setattr(dg, "_GPU_CHUNK_BYTES", 1000)  # 11 chunks through both buffers
    assert "xxh3-128:" + dg._device_digest(data).hex() == _expected(data.numpy().tobytes())
    assert dg._device_digest(data[:0]).hex() == xxhash.xxh3_128_hexdigest(b"")


def test_root_digest_is_the_documented_canonical_encoding() -> None:
    entries = [("a.weight", "bfloat16", (2, 3), tensor_digest(torch.zeros(2, 3))), ("b", "uint8", [4], "xxh3-128:" + "0" * 32)]
    text = json.dumps(
        ["weftboard-root-v1", [[n, d, list(s), g] for n, d, s, g in entries]], separators=(",", ":"), ensure_ascii=True
    )
    assert root_encoding(entries) == text.encode()
    assert root_digest(entries) == _expected(text.encode())


def test_root_digest_depends_on_every_field_and_order() -> None:
    d0 = tensor_digest(torch.zeros(4))
    d1 = tensor_digest(torch.ones(4))
    base = [("x", "float32", (4,), d0), ("y", "float32", (4,), d1)]
    variants = [
        list(reversed(base)),
        [("x", "float32", (2, 2), d0), base[1]],
        [("x", "bfloat16", (4,), d0), base[1]],
        [("x", "float32", (4,), d1), base[1]],
        [("x\t", "float32", (4,), d0), base[1]],
        [("x", "float32", (4,), d0)],
    ]
    digests = {root_digest(v) for v in variants}
    assert root_digest(base) not in digests
    assert len(digests) == len(variants)
    # names that would collide under naive joining stay distinct
    assert root_digest([("a,b", "u8", (1,), d0)]) != root_digest([("a", "b,u8", (1,), d0)])
    assert np.all([g.startswith("xxh3-128:") and len(g) == 41 for g in digests])
