"""The patch codec: lossless round trips for every mode and dtype, the container contract,
validation before any write, revert, and size against the entropy bound."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load as st_load

from weftboard.cuda import encode, formats
from weftboard.cuda.bench.bench_codec import entropy_bound_bits
from weftboard.cuda.codec import (
    CODEC_TILE,
    apply_patch_,
    encode_deltas,
    encode_patch,
    read_patch_info,
)
from weftboard.cuda.diff import bits_view, diff_tensor, unsigned_np
from weftboard.proto.errors import CorruptData, InvalidArgument

ROOT = "xxh3-128:" + "ab" * 16


def _bits(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g).view(dtype)


def _change(t: torch.Tensor, positions: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    b = bits_view(out)
    if b.dtype == torch.uint8:
        b[positions] = ((b[positions].to(torch.int64) + delta) % 256).to(torch.uint8)
    else:
        b[positions] = (b[positions].to(torch.int64) + delta).to(b.dtype)
    return out


def _roundtrip(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], encoding: str = "default"):
    patch = encode_patch(((n, a, b) for n, (a, b) in pairs.items()), base_version=4, target_version=5, target_root=ROOT, encoding=encoding)
    target = {n: a.clone() for n, (a, _) in pairs.items()}
    applied = apply_patch_(target, patch.data)
    for n, (a, b) in pairs.items():
        assert torch.equal(bits_view(target[n]), bits_view(b.contiguous())), n
    assert applied.changed == patch.changed
    assert (applied.base_version, applied.target_version, applied.target_root) == (4, 5, ROOT)
    applied.revert()
    for n, (a, _) in pairs.items():
        assert torch.equal(bits_view(target[n]), bits_view(a.contiguous())), n
    return patch


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.float64]


@pytest.mark.parametrize("encoding", ["default", "baseline"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", [0.0, 0.0005, 0.02, 0.6, 1.0])
def test_roundtrip_every_dtype_and_density(encoding: str, dtype: torch.dtype, density: float) -> None:
    n = CODEC_TILE + 4099  # two tiles, the last one partial
    old = _bits(n, dtype, seed=int(density * 1e4))
    g = torch.Generator().manual_seed(1)
    k = int(n * density)
    pos = torch.randperm(n, generator=g)[:k]
    step = torch.where(torch.rand(k, generator=g) < 0.5, 1, -1) * torch.randint(1, 3, (k,), generator=g)
    new = _change(old, pos, step)
    patch = _roundtrip({"w": (old, new), "small": (old[:5], new[:5])}, encoding)
    assert patch.changed["w"] == int((bits_view(old) != bits_view(new)).sum())
    assert patch.numel == {"w": n, "small": 5}


def _adversarial(dtype: torch.dtype) -> torch.Tensor:
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3.0e38, -1.0, 1.0])
    return specials.to(dtype) if dtype.is_floating_point else torch.arange(10, dtype=torch.uint8) * 25


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lossless_on_adversarial_values(dtype: torch.dtype) -> None:
    base = _bits(20_000, dtype, seed=2)
    new = base.clone()
    nb = bits_view(new)
    specials = bits_view(_adversarial(dtype).contiguous())
    nb[:: 997][: specials.numel()] = specials  # NaN/Inf/-0 bit patterns in place of values
    nb[5000:5100] = ~nb[5000:5100]  # far jumps (every bit flips, sign included)
    nb[7000:7050] = -nb[7000:7050] if nb.dtype != torch.uint8 else 255 - nb[7000:7050]
    nb[9000] = nb[9000] + 64  # exactly the largest coded difference
    nb[9001] = nb[9001] - 64
    nb[9002] = nb[9002] + 65  # one past it: an escape
    nan_payload = base.clone()
    bits_view(nan_payload)[::7] ^= 1
    _roundtrip({"a": (base, new), "b": (base, nan_payload)})


def test_odd_sizes_and_shapes() -> None:
    pairs = {}
    for i, shape in enumerate([(1,), (3,), (7, 5), (CODEC_TILE + 1,), (2, CODEC_TILE // 2 + 3)]):
        old = _bits(int(np.prod(shape)), torch.bfloat16, seed=i).reshape(shape)
        new = old.clone()
        bits_view(new)[-1] += 1
        bits_view(new)[0] -= 1
        pairs[f"t{i}"] = (old, new)
    _roundtrip(pairs)


def test_modes_fall_back_to_the_smallest_stream() -> None:
    n = 50_000
    g = torch.Generator().manual_seed(3)
    old = _bits(n, torch.bfloat16, seed=3)
    sparse = _change(old, torch.arange(0, n, 97), torch.tensor(1))
    dense_random = old.clone()  # half the elements, i.i.d., replaced by random bits
    pick = torch.rand(n, generator=g) < 0.5
    bits_view(dense_random)[pick] = bits_view(_bits(n, torch.bfloat16, seed=9))[pick]
    clustered = old.clone()  # a dense run inside a sparse tensor: per-tile Rice adapts to it
    bits_view(clustered)[10_000:20_000] ^= 0x00FF
    every = _change(old, torch.arange(n), torch.tensor(1))
    pairs = {"sparse": (old, sparse), "dense": (old, dense_random), "clustered": (old, clustered), "all": (old, every), "same": (old, old)}
    patch = _roundtrip(pairs)
    info = {t.name: t for t in read_patch_info(patch.data).tensors}
    assert {n: t.mode for n, t in info.items()} == {
        "sparse": "huffman", "dense": "bitmap", "clustered": "huffman", "all": "all", "same": "empty"
    }
    assert info["all"].stream_bytes == n * 2  # 100% dense costs exactly the raw bytes
    for name, t in info.items():  # the chosen stream is never larger than the alternative
        bitmap_bytes = (n + 7) // 8 + t.changed * 2
        if t.mode == "huffman":
            assert t.stream_bytes <= bitmap_bytes
        if t.mode == "bitmap":
            d = diff_tensor(*pairs[name])
            huffman_bytes = encode._encode_huffman(
                d.positions.numpy(), unsigned_np(d.old_bits), unsigned_np(d.new_bits), n, CODEC_TILE
            ).size
            assert t.stream_bytes < huffman_bytes


def test_four_bit_and_fp8_formats_round_trip_with_their_scales() -> None:
    master = formats.make_test_master(layers=1, hidden=128, intermediate=256, vocab=256)
    (stepped,) = list(formats.adamw_steps(master, 1, lr=1e-3))
    for kind in ("fp8_e4m3", "mxfp4", "nvfp4"):
        proj = formats.Projector(formats.ServedFormatSpec(kind, scale_policy="recompute"))
        old = proj.project(master, anchor=True)
        new = proj.project(stepped, anchor=False)
        assert any(n.endswith("_scale") for n in new)
        changed_scales = [n for n in new if n.endswith("_scale") and not torch.equal(bits_view(old[n]), bits_view(new[n]))]
        assert changed_scales, f"{kind}: the step should move some scale so the test covers it"
        patch = _roundtrip({n: (old[n], new[n]) for n in new})
        assert sum(patch.changed.values()) == formats.transition_density(old, new).changed


def test_container_is_a_safetensors_file_with_the_documented_header(tmp_path) -> None:
    old = _bits(10_000, torch.bfloat16, seed=4)
    new = _change(old, torch.arange(0, 10_000, 50), torch.tensor(1))
    patch = encode_patch([("layer.0.w", old, new), ("layer.1.w", old, old)], base_version=1, target_version=2, target_root=ROOT)
    path = tmp_path / "p.safetensors"
    path.write_bytes(patch.data)
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
        assert list(f.keys()) == ["layer.0.w"]  # unchanged tensors carry no stream
        stream = f.get_tensor("layer.0.w")
    header = json.loads(meta["weftboard"])
    assert header["format"] == "weftboard-patch" and header["format_version"] == 2
    assert header["encoding"] == "default" and header["base_version"] == 1 and header["target_version"] == 2
    assert header["target_root"] == ROOT
    entry = header["tensors"][0]
    assert entry["name"] == "layer.0.w" and entry["dtype"] == "bfloat16" and entry["numel"] == 10_000
    assert entry["changed"] == 200 and entry["mode"] == "huffman" and entry["stream_bytes"] == stream.size
    assert header["tensors"][1]["mode"] == "empty"
    assert stream.dtype == np.uint8
    assert set(st_load(patch.data)) == {"layer.0.w"}
    info = read_patch_info(patch.data)
    assert (info.format_version, info.encoding, info.total_changed) == (2, "default", 200)


def test_encode_deltas_equals_encode_patch() -> None:
    old = _bits(70_000, torch.float16, seed=5)
    new = _change(old, torch.arange(3, 70_000, 31), torch.tensor(-1))
    kw = dict(base_version=1, target_version=2, target_root=ROOT)
    a = encode_patch([("w", old, new)], **kw)
    b = encode_deltas([("w", diff_tensor(old, new))], **kw)
    assert a.data == b.data


def _two_tensor_patch():
    old1 = _bits(5000, torch.bfloat16, seed=6)
    new1 = _change(old1, torch.arange(0, 5000, 10), torch.tensor(1))
    old2 = _bits(6000, torch.bfloat16, seed=7)
    new2 = _change(old2, torch.arange(0, 6000, 7), torch.tensor(-1))
    patch = encode_patch([("a", old1, new1), ("b", old2, new2)], base_version=1, target_version=2, target_root=ROOT)
    return patch, {"a": old1, "b": old2}


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t: t.pop("b"), "does not have"),
        (lambda t: t.__setitem__("b", t["b"].float()), "destination holds"),
        (lambda t: t.__setitem__("b", t["b"][:-1].clone()), "destination holds"),
    ],
    ids=["unknown-tensor", "wrong-dtype", "wrong-numel"],
)
def test_mismatched_destination_is_refused_before_any_write(mutate, match) -> None:
    patch, olds = _two_tensor_patch()
    target = {n: t.clone() for n, t in olds.items()}
    mutate(target)
    with pytest.raises(CorruptData, match=match):
        apply_patch_(target, patch.data)
    assert torch.equal(bits_view(target["a"]), bits_view(olds["a"]))  # "a" comes first and was not written


def test_corrupted_second_stream_leaves_first_tensor_untouched() -> None:
    patch, olds = _two_tensor_patch()
    data = bytearray(patch.data)
    data[-3] ^= 0x40  # inside the last stream ("b")
    target = {n: t.clone() for n, t in olds.items()}
    with pytest.raises(CorruptData, match="'b'.*xxh3-64"):
        apply_patch_(target, bytes(data))
    assert all(torch.equal(bits_view(target[n]), bits_view(olds[n])) for n in olds)


@pytest.mark.parametrize("cut", [0, 4, 8, 100, -1, -50])
def test_truncated_patch_is_corrupt(cut: int) -> None:
    patch, olds = _two_tensor_patch()
    data = patch.data[:cut] if cut >= 0 else patch.data[:cut]
    with pytest.raises(CorruptData):
        apply_patch_({n: t.clone() for n, t in olds.items()}, data)
    with pytest.raises(CorruptData):
        read_patch_info(data)


def test_tampered_header_is_corrupt() -> None:
    patch, olds = _two_tensor_patch()
    (hlen,) = struct.unpack("<Q", patch.data[:8])
    text = patch.data[8 : 8 + hlen].replace(b'\\"target_version\\":2', b'\\"target_version\\":3')
    assert text != patch.data[8 : 8 + hlen]
    with pytest.raises(CorruptData, match="header fails"):
        read_patch_info(patch.data[:8] + text + patch.data[8 + hlen :])
    with pytest.raises(CorruptData, match="not a weftboard-patch"):
        read_patch_info(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")


def test_bad_inputs_to_the_encoder() -> None:
    t = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgument):
        encode_patch([("w", t, t)], base_version=1, target_version=2, target_root=ROOT, encoding="zstd")
    with pytest.raises(InvalidArgument):
        encode_patch([("w", t, t), ("w", t, t)], base_version=1, target_version=2, target_root=ROOT)


def test_realistic_bf16_update_is_near_the_entropy_bound_and_far_below_baseline() -> None:
    g = torch.Generator().manual_seed(0)
    master = {f"m{i}": torch.randn(512, 1024, generator=g) * 0.02 for i in range(2)}
    master["norm"] = 1 + 0.05 * torch.randn(1024, generator=g)
    step = {n: m - 3e-6 * torch.sign(torch.randn(m.shape, generator=g)) for n, m in master.items()}
    old = {n: m.bfloat16() for n, m in master.items()}
    new = {n: m.bfloat16() for n, m in step.items()}
    patch = _roundtrip({n: (old[n], new[n]) for n in old})
    base = encode_patch(((n, old[n], new[n]) for n in old), base_version=4, target_version=5, target_root=ROOT, encoding="baseline")
    bound_bits, changes, _ = entropy_bound_bits(old, new)
    assert changes == sum(patch.changed.values()) > 10_000
    assert len(patch.data) <= 1.10 * bound_bits / 8
    assert len(base.data) >= 4.5 * len(patch.data)
