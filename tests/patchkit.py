"""Helpers for tests of the patch container."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from safetensors import safe_open
from safetensors.numpy import load_file

from weftboard.cuda import container
from weftboard.cuda.container import torch_dtype


def with_header(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """``data`` with its weftboard header changed in place by ``edit`` and the header's
    checksum made consistent again, so only the rule a test aims at can refuse the patch."""
    (hlen,) = struct.unpack("<Q", data[:8])
    st_header = json.loads(data[8 : 8 + hlen])
    header = json.loads(st_header["__metadata__"]["weftboard"])
    edit(header)
    text = json.dumps(header)
    st_header["__metadata__"] = {"weftboard": text, "weftboard_xxh3_64": xxhash.xxh3_64_hexdigest(text.encode())}
    blob = json.dumps(st_header).encode()
    return struct.pack("<Q", len(blob)) + blob + data[8 + hlen :]


# Format 1 patches (``sparse`` streams, rANS-coded values) written by the retired v1 writer:
# the reader must keep decoding them bitwise. See tests/data/v1_patches/README.md.
DATA = Path(__file__).parent / "data"
V1_PATCHES = DATA / "v1_patches"
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class PatchFixture:
    """A committed patch and the tensors it transforms, as unsigned bits (``base``, ``expected``)."""

    path: Path
    data: bytes
    entries: dict[str, dict[str, Any]]  # the header's tensor entries, by name
    base: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]

    def stream(self, name: str) -> bytes:
        return bytes(container.read_container(self.data).streams[name])

    def tensors(self, which: str = "base") -> dict[str, torch.Tensor]:
        """Fresh tensors of the entries' dtypes holding ``base`` or ``expected``."""
        bits = self.base if which == "base" else self.expected
        return {n: torch.from_numpy(bits[n].copy()).view(torch_dtype(e["dtype"], n)) for n, e in self.entries.items()}


def patch_fixture_paths() -> list[Path]:
    """Every committed patch fixture under tests/data: a safetensors file with a ``patch`` key."""
    return sorted(p for p in DATA.rglob("*.safetensors") if _holds_a_patch(p))


def _holds_a_patch(path: Path) -> bool:
    with safe_open(str(path), "np") as f:
        return "patch" in set(f.keys())


def load_patch_fixture(path: Path | str) -> PatchFixture:
    """A fixture by path, or by its stem under tests/data/v1_patches."""
    path = V1_PATCHES / f"{path}.safetensors" if isinstance(path, str) else path
    arrays = load_file(str(path))
    data = arrays["patch"].tobytes()
    entries = {e["name"]: e for e in container.read_container(data).entries}
    base, expected = {}, {}
    for name, e in entries.items():
        u = UNSIGNED[torch.empty(0, dtype=torch_dtype(e["dtype"], name)).element_size()]
        base[name] = arrays[f"base/{name}"].view(u).reshape(-1)
        expected[name] = arrays[f"expected/{name}"].view(u).reshape(-1)
    return PatchFixture(path, data, entries, base, expected)


def optimizer_step(n: int, dtype: torch.dtype, seed: int, lr: float = 3e-6, steps: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) served views of weights with std 0.02 moved by ``steps`` sign-like steps."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen) * 0.02
    moved = master + lr * steps * torch.sign(torch.randn(n, generator=gen))
    return master.to(dtype), moved.to(dtype)


def u16(t: torch.Tensor) -> np.ndarray:
    """The 16-bit float tensor's bits as a uint16 array (no copy)."""
    return t.reshape(-1).view(torch.int16).numpy().view(np.uint16)
