"""Served-format projections: exact bytes against torch's casts and the reference 4-bit vectors.

The reference vectors (tests/data/quant_reference.safetensors) were made by torchao, an
implementation this project did not write; every case must match bit for bit, data and
scales. fp8 is checked against torch's own casts and against an independent brute-force
nearest-even search over every fp8 code.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from weftboard.cuda import formats_fp4 as fp4
from weftboard.cuda import formats_fp8 as fp8
from weftboard.cuda.formats import (
    KINDS,
    Projector,
    ServedFormatSpec,
    dequantize,
    dequantize_view,
    dtype_name,
    is_scale_tensor,
    make_served_view,
    make_test_master,
    transition_density,
)
from weftboard.proto.errors import FailedPrecondition, InvalidArgument
from weftboard.proto.v1 import board_pb2 as pb

VECTORS = Path(__file__).parent / "data" / "quant_reference.safetensors"
CASES = ("normal_small", "normal_unit", "outliers", "norm_weights", "tiny", "with_zero_blocks")


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_file(str(VECTORS))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (bits(actual) != bits(expected)).nonzero().reshape(-1)
    assert diff.numel() == 0, f"{what}: {diff.numel()} elements differ, first at flat index {diff[:5].tolist()}"


# ---------------------------------------------------------------------------
# reference vectors, bit for bit
# ---------------------------------------------------------------------------


def test_vectors_hold_every_documented_case(ref):
    assert {k.split(".")[0] for k in ref} == set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_mxfp4_matches_reference(ref, case):
    data, scale = fp4.mxfp4_quantize(ref[f"{case}.input_bf16"])
    assert_bitwise(scale, ref[f"{case}.mxfp4.scale_e8m0"], "E8M0 scales")
    assert_bitwise(data, ref[f"{case}.mxfp4.data"], "packed e2m1 data")


@pytest.mark.parametrize("case", CASES)
def test_nvfp4_one_level_matches_reference(ref, case):
    data, block, tensor = fp4.nvfp4_quantize(ref[f"{case}.input_bf16"], two_level=False)
    assert tensor is None
    assert block.dtype == torch.float8_e4m3fn
    assert_bitwise(block.view(torch.uint8), ref[f"{case}.nvfp4_1level.scale_e4m3"], "e4m3 block scales")
    assert_bitwise(data, ref[f"{case}.nvfp4_1level.data"], "packed e2m1 data")


@pytest.mark.parametrize("case", CASES)
def test_nvfp4_two_level_matches_reference(ref, case):
    data, block, tensor = fp4.nvfp4_quantize(ref[f"{case}.input_bf16"])
    assert_bitwise(tensor, ref[f"{case}.nvfp4_2level.tensor_scale"], "tensor scale")
    assert_bitwise(block.view(torch.uint8), ref[f"{case}.nvfp4_2level.scale_e4m3"], "e4m3 block scales")
    assert_bitwise(data, ref[f"{case}.nvfp4_2level.data"], "packed e2m1 data")


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_projector_stores_the_reference_bytes(ref, kind):
    """The publisher's path (Projector, stored names) yields exactly the reference tensors."""
    master = {f"model.w{i}.weight": ref[f"{case}.input_bf16"] for i, case in enumerate(CASES)}
    served = Projector(ServedFormatSpec(kind, scale_policy="recompute")).project(master, anchor=True)
    for i, case in enumerate(CASES):
        name = f"model.w{i}.weight"
        if kind == "mxfp4":
            assert list(served)[list(served).index(name) + 1] == name + "_scale"
            assert_bitwise(served[name], ref[f"{case}.mxfp4.data"], f"{case} data")
            assert_bitwise(served[name + "_scale"], ref[f"{case}.mxfp4.scale_e8m0"], f"{case} scales")
        else:
            assert_bitwise(served[name], ref[f"{case}.nvfp4_2level.data"], f"{case} data")
            assert_bitwise(
                served[name + "_scale"].view(torch.uint8), ref[f"{case}.nvfp4_2level.scale_e4m3"], f"{case} scales"
            )
            assert_bitwise(served[name + "_scale_2"], ref[f"{case}.nvfp4_2level.tensor_scale"], f"{case} tensor scale")


# ---------------------------------------------------------------------------
# e2m1 codes
# ---------------------------------------------------------------------------


def brute_force_nearest_even(x: torch.Tensor, grid: torch.Tensor, even_code: torch.Tensor) -> torch.Tensor:
    """Index into ``grid`` (ascending magnitudes) nearest to |x|, ties to the even code."""
    distance = (x.abs().unsqueeze(-1).double() - grid.double()).abs()
    best = distance.min(dim=-1, keepdim=True).values
    tied = distance == best
    # among tied candidates prefer an even code, then the smaller index
    preference = torch.where(tied, (~even_code).long(), torch.full_like(distance, 10, dtype=torch.long))
    return (preference * len(grid) + torch.arange(len(grid))).argmin(dim=-1)


def test_e2m1_encode_is_nearest_even_and_saturating():
    gen = torch.Generator().manual_seed(3)
    grid = torch.tensor(fp4.E2M1_VALUES)
    midpoints = (grid[1:] + grid[:-1]) / 2
    x = torch.cat(
        [
            torch.randn(20000, generator=gen) * 3,
            grid,
            -grid,
            midpoints,
            -midpoints,
            torch.tensor([6.5, 7.0, 100.0, -1e30, float("inf"), float("-inf"), -0.0, 1e-40]),
        ]
    ).float()
    codes = fp4.e2m1_encode(x)
    even = torch.arange(8) % 2 == 0
    expected = brute_force_nearest_even(x.clamp(-6, 6), grid, even).to(torch.uint8)
    expected |= torch.signbit(x).to(torch.uint8) << 3
    assert torch.equal(codes, expected)
    # the ties explicitly: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert fp4.e2m1_decode(fp4.e2m1_encode(midpoints)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_e2m1_encode_matches_brute_force_on_any_float(values):
    x = torch.tensor(values, dtype=torch.float32)
    grid = torch.tensor(fp4.E2M1_VALUES)
    expected = brute_force_nearest_even(x.clamp(-6, 6), grid, torch.arange(8) % 2 == 0).to(torch.uint8)
    expected |= torch.signbit(x).to(torch.uint8) << 3
    assert torch.equal(fp4.e2m1_encode(x), expected)


def test_e2m1_nan_and_sign_of_zero():
    codes = fp4.e2m1_encode(torch.tensor([float("nan"), -0.0, 0.0, -0.1]))
    assert codes.tolist() == [0, 8, 0, 8]
    all_codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(fp4.e2m1_encode(fp4.e2m1_decode(all_codes)), all_codes)


def test_nibble_packing_order_and_roundtrip():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = fp4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(fp4.unpack_nibbles(packed), codes)
    with pytest.raises(ValueError):
        fp4.pack_nibbles(torch.zeros(1, 3, dtype=torch.uint8))


# ---------------------------------------------------------------------------
# fp8 against torch's casts and a brute-force nearest-even search
# ---------------------------------------------------------------------------


def fp8_grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative finite values of an fp8 dtype, ascending, and whether each code is even."""
    codes = torch.arange(128, dtype=torch.uint8)
    values = codes.view(dtype).float()
    finite = torch.isfinite(values)
    return values[finite], (codes[finite] % 2 == 0)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_per_tensor_matches_torch_and_brute_force(dtype):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(96, 160, generator=gen) * 0.02).to(torch.bfloat16)
    x.view(-1)[:7] = torch.tensor([0.0, -0.0, 1e-30, -3e-3, 0.5, -0.49, 0.125], dtype=torch.bfloat16)
    values, scale = fp8.fp8_quantize(x, dtype)
    amax = float(x.float().abs().max())
    # the scale is amax / max rounded once to float32 (double then float32 is exact here)
    expected_scale = torch.tensor([amax / float(torch.finfo(dtype).max)], dtype=torch.float32)
    assert_bitwise(scale, expected_scale, "scale")
    scaled = x.float() / scale
    assert_bitwise(values, scaled.to(dtype), "values vs torch cast")
    grid, even = fp8_grid(dtype)
    nearest = grid[brute_force_nearest_even(scaled.reshape(-1), grid, even)]
    expected = torch.where(torch.signbit(scaled.reshape(-1)), -nearest, nearest).reshape(x.shape)
    assert_bitwise(values.float(), expected, "values vs brute-force RNE")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_block128_scales_cover_partial_edge_blocks(dtype):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(200, 300, generator=gen) * torch.logspace(-3, 0, 300)
    x[130:200, 260:300] = 0.0  # a whole (partial) edge block of zeros
    values, scale = fp8.fp8_quantize(x, dtype, "block128")
    assert scale.shape == (2, 3)
    fmax = float(torch.finfo(dtype).max)
    for r in range(2):
        for c in range(3):
            tile = x[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128]
            amax = float(tile.abs().max())
            want = amax / fmax if amax else 2.0**-126
            assert scale[r, c].item() == torch.tensor(want, dtype=torch.float32).item(), (r, c)
            expected = (tile / scale[r, c]).to(dtype)
            assert_bitwise(values[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128], expected, f"block {r},{c}")
    assert torch.all(values[130:200, 260:300].float() == 0)


def test_fp8_non_finite_values():
    x = torch.tensor([[1.0, -2.0, float("nan"), float("inf"), float("-inf"), 0.5]])
    values, scale = fp8.fp8_quantize(x, torch.float8_e4m3fn)
    assert scale.item() == pytest.approx(2.0 / 448.0)  # from finite values only
    out = values.float()
    assert out[0, 1].item() == -448.0 and out[0, 0].item() == 224.0
    assert math.isnan(out[0, 2].item())
    assert out[0, 3].item() == 448.0 and out[0, 4].item() == -448.0  # saturated, not NaN


def test_fp8_out_of_range_saturates_instead_of_nan():
    kept = torch.tensor([1.0])
    values = fp8.fp8_encode(torch.tensor([[500.0, -1e6, 460.0]]), kept, torch.float8_e4m3fn)
    assert values.float().tolist() == [[448.0, -448.0, 448.0]]


# ---------------------------------------------------------------------------
# non-finite and degenerate 4-bit blocks
# ---------------------------------------------------------------------------


def test_fp4_nan_poisons_only_its_block_and_inf_saturates():
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-1, 1, 32)
    x[0, 3] = float("nan")
    x[0, 40] = float("inf")
    x[0, 41] = 0.75
    data, scale = fp4.mxfp4_quantize(x)
    assert scale[0, 0].item() == fp4.E8M0_NAN
    back = fp4.mxfp4_dequantize(data, scale)
    assert torch.isnan(back[0, :32]).all()
    assert torch.isfinite(back[0, 32:]).all()
    assert back[0, 41].item() == 0.75 and back[0, 40].item() == 6 * 2.0 ** (scale[0, 1].item() - 127)
    ndata, nblock, ntensor = fp4.nvfp4_quantize(x)
    assert torch.isnan(nblock.float()[0, 0]) and torch.isfinite(nblock.float()[0, 1:]).all()  # 16-wide blocks
    assert torch.isfinite(ntensor).all()
    nback = fp4.nvfp4_dequantize(ndata, nblock, ntensor)
    assert torch.isnan(nback[0, :16]).all() and torch.isfinite(nback[0, 16:]).all()


# ---------------------------------------------------------------------------
# round trips: error bounds and idempotence
# ---------------------------------------------------------------------------


def e2m1_half_gap(scaled: torch.Tensor) -> torch.Tensor:
    """Largest rounding error of e2m1 at each magnitude (saturation included)."""
    a = scaled.abs()
    gap = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
    return torch.where(a > 6, a - 6, gap)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("granularity", ["tensor", "block128"])
def test_dequantize_is_within_the_format_error_bound(kind, granularity):
    if granularity == "block128" and not kind.startswith("fp8"):
        pytest.skip("block128 is an fp8 granularity")
    master = make_test_master(layers=1, hidden=128, intermediate=256, vocab=256, seed=7)
    served = Projector(ServedFormatSpec(kind, granularity, "recompute")).project(master, anchor=True)
    name = "model.layers.0.mlp.down_proj.weight"
    x = master[name]
    back = dequantize(served, name)
    err = (back - x).abs()
    if kind.startswith("fp8"):
        dtype = fp8.FP8_DTYPES[kind]
        mant = 3 if dtype == torch.float8_e4m3fn else 2
        tiny = 2.0 ** (-9 if mant == 3 else -16)  # smallest subnormal step, in scaled units
        scale = served[name + ("_scale_inv" if granularity == "block128" else "_scale")]
        per_elem = scale if scale.numel() == 1 else scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: x.shape[0], : x.shape[1]]
        bound = torch.maximum(x.abs() * 2.0 ** -(mant + 1), per_elem * tiny / 2) * (1 + 1e-6)
    elif kind == "mxfp4":
        s = fp4.e8m0_to_float(served[name + "_scale"]).repeat_interleave(32, 1)
        bound = (e2m1_half_gap(x / s) + 1e-6) * s
    else:
        s = (served[name + "_scale"].float() * served[name + "_scale_2"]).repeat_interleave(16, 1)
        bound = (e2m1_half_gap(x / s) + 1e-5) * s  # float32 slack of scale products
    worst = (err - bound).max().item()
    assert worst <= 0, f"an element is {worst} beyond the format's rounding bound"
    # the bf16 companions (norms, embeddings) are plain bf16 casts
    assert torch.equal(dequantize(served, "model.norm.weight"), master["model.norm.weight"].to(torch.bfloat16).float())


def test_mxfp4_projection_is_idempotent_on_its_own_output():
    """The floor rule maps a block's dequantized max back to the same exponent: same bytes."""
    master = make_test_master(layers=1, hidden=128, intermediate=256, vocab=256, seed=8)
    spec = ServedFormatSpec("mxfp4", scale_policy="recompute")
    first = Projector(spec).project(master, anchor=True)
    again = Projector(spec).project(dequantize_view(first), anchor=True)
    assert list(again) == list(first)
    for name in first:
        assert_bitwise(again[name], first[name], name)


_magnitudes = st.one_of(st.just(0.0), st.floats(min_value=2.0**-100, max_value=2.0**120, width=32))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_magnitudes, st.booleans()), min_size=64, max_size=64))
def test_mxfp4_bytes_survive_dequantize_and_reproject_for_any_values(pairs):
    """Any finite block above E8M0's clamped bottom (2^-124) round-trips bitwise."""
    x = torch.tensor([-m if negative else m for m, negative in pairs], dtype=torch.float32).reshape(2, 32)
    data, scale = fp4.mxfp4_quantize(x)
    data2, scale2 = fp4.mxfp4_quantize(fp4.mxfp4_dequantize(data, scale))
    assert torch.equal(scale2, scale)
    assert torch.equal(data2, data)


@pytest.mark.parametrize(
    "kind,granularity", [("fp8_e4m3", "tensor"), ("fp8_e5m2", "block128"), ("nvfp4", "tensor")]
)
def test_pow2_projection_is_idempotent_in_value(kind, granularity):
    """With power-of-two scales re-projecting keeps every dequantized value exactly.

    The bytes may differ: a block whose max rounded down onto a power of two (e.g. 231 -> 224
    in e4m3) is re-projected with half the scale and doubled codes, the same numbers. No
    non-clipping power-of-two rule avoids that, since the grid is the same in every binade.
    """
    master = make_test_master(layers=1, hidden=128, intermediate=256, vocab=256, seed=8)
    spec = ServedFormatSpec(kind, granularity, "pow2")
    first = dequantize_view(Projector(spec).project(master, anchor=True))
    again = dequantize_view(Projector(spec).project(first, anchor=True))
    for name in first:
        assert_bitwise(again[name], first[name], name)


@pytest.mark.parametrize("kind,granularity", [("fp8_e4m3", "tensor"), ("fp8_e4m3", "block128"), ("fp8_e5m2", "tensor"), ("mxfp4", "tensor"), ("nvfp4", "tensor")])
def test_projection_is_idempotent_with_kept_scales(kind, granularity):
    """With the scales kept (policy "fixed"), every format reproduces its own bytes."""
    master = make_test_master(layers=1, hidden=128, intermediate=256, vocab=256, seed=9)
    spec = ServedFormatSpec(kind, granularity, "fixed")
    first = Projector(spec).project(master, anchor=True)
    projector = Projector(spec)
    projector.resume_from(first)
    again = projector.project(dequantize_view(first), anchor=False)
    for name in first:
        assert_bitwise(again[name], first[name], name)


# ---------------------------------------------------------------------------
# the projector: names, layout, dtypes, devices
# ---------------------------------------------------------------------------


def test_stored_names_and_companions_follow_engine_conventions():
    master = make_test_master(layers=1, hidden=128, intermediate=256, vocab=256)
    q = "model.layers.0.self_attn.q_proj.weight"
    expected = {
        ("fp8_e4m3", "tensor"): [(q, "float8_e4m3fn", (128, 128)), (q + "_scale", "float32", (1,))],
        ("fp8_e5m2", "block128"): [(q, "float8_e5m2", (128, 128)), (q + "_scale_inv", "float32", (1, 1))],
        ("mxfp4", "tensor"): [(q, "uint8", (128, 64)), (q + "_scale", "uint8", (128, 4))],
        ("nvfp4", "tensor"): [
            (q, "uint8", (128, 64)),
            (q + "_scale", "float8_e4m3fn", (128, 8)),
            (q + "_scale_2", "float32", (1,)),
        ],
    }
    for (kind, granularity), entries in expected.items():
        layout = Projector(ServedFormatSpec(kind, granularity)).layout(master)
        start = [n for n, _, _ in layout].index(q)
        assert layout[start : start + len(entries)] == entries
        kept = {n: d for n, d, _ in layout}
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.0.input_layernorm.weight"):
            assert kept[name] == "bfloat16", (kind, name)


def test_what_stays_unquantized():
    master = {
        "a.weight": torch.randn(64, 48),  # 48 is not a multiple of 32: mxfp4 keeps it bf16
        "b.weight": torch.randn(4, 64, 64),  # 3-D
        "c.bias": torch.randn(64),
        "d.rotary_inv_freq": torch.randn(64, 64),  # 2-D but not a weight
        "e.step": torch.arange(4),  # integer buffer
        "f.weight": torch.randn(64, 64, dtype=torch.float64),
    }
    layout = {n: (d, s) for n, d, s in Projector(ServedFormatSpec("mxfp4")).layout(master)}
    assert layout["a.weight"] == ("bfloat16", (64, 48))
    assert layout["b.weight"] == ("bfloat16", (4, 64, 64))
    assert layout["c.bias"] == ("bfloat16", (64,))
    assert layout["d.rotary_inv_freq"] == ("bfloat16", (64, 64))
    assert layout["e.step"] == ("int64", (4,))
    assert layout["f.weight"] == ("uint8", (64, 32))
    fp8_layout = {n: d for n, d, _ in Projector(ServedFormatSpec("fp8_e4m3")).layout(master)}
    assert fp8_layout["a.weight"] == "float8_e4m3fn"  # fp8 takes any width


def test_keep_patterns_replace_the_defaults():
    master = make_test_master(layers=1, hidden=128, intermediate=256, vocab=256)
    spec = ServedFormatSpec("fp8_e4m3", keep_bf16_patterns=("*.mlp.*",))
    kinds = {n: d for n, d, _ in Projector(spec).layout(master)}
    assert kinds["model.layers.0.mlp.up_proj.weight"] == "bfloat16"
    assert kinds["lm_head.weight"] == "float8_e4m3fn"  # no longer a default keep
    fp16 = {n: d for n, d, _ in Projector(ServedFormatSpec("fp16")).layout(master)}
    assert set(fp16.values()) == {"float16"}
    fp16_keep = {n: d for n, d, _ in Projector(ServedFormatSpec("fp16", keep_bf16_patterns=("*norm*",))).layout(master)}
    assert fp16_keep["model.norm.weight"] == "bfloat16" and fp16_keep["lm_head.weight"] == "float16"


@pytest.mark.parametrize("kind", KINDS)
def test_layout_predicts_project_without_values(kind):
    master = make_test_master(layers=1, hidden=128, intermediate=256, vocab=256)
    master["model.position_ids"] = torch.arange(16)
    granularities = ["tensor", "block128"] if kind.startswith("fp8") else ["tensor"]
    for granularity in granularities:
        projector = Projector(ServedFormatSpec(kind, granularity))
        meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in master.items()}
        layout = projector.layout(meta)
        served = projector.project(master, anchor=True)
        assert [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in served.items()] == layout
        for name, tensor in served.items():
            assert tensor.is_contiguous()
            assert is_scale_tensor(name) == name.endswith(("_scale", "_scale_inv", "_scale_2"))


def test_projection_never_aliases_the_master():
    master = {"x.weight": torch.randn(8, 8, dtype=torch.bfloat16), "ids": torch.arange(3)}
    for kind in ("bf16", "raw"):
        served = Projector(ServedFormatSpec(kind)).project(master, anchor=True)
        before = {n: t.clone() for n, t in served.items()}
        master["x.weight"].add_(1.0)
        master["ids"].add_(1)
        for name in served:
            assert torch.equal(served[name], before[name])


def test_name_collision_is_refused():
    master = {"x.weight": torch.randn(32, 32), "x.weight_scale": torch.randn(1)}
    with pytest.raises(InvalidArgument, match="produced twice"):
        Projector(ServedFormatSpec("fp8_e4m3")).project(master, anchor=True)


def test_non_contiguous_master_is_projected_as_its_values():
    base = torch.randn(64, 96)
    master_t = {"x.weight": base.t()}  # [96, 64], non-contiguous
    master_c = {"x.weight": base.t().contiguous()}
    for kind in ("fp8_e4m3", "mxfp4", "nvfp4", "bf16"):
        a = Projector(ServedFormatSpec(kind)).project(master_t, anchor=True)
        b = Projector(ServedFormatSpec(kind)).project(master_c, anchor=True)
        for name in a:
            assert_bitwise(a[name], b[name], f"{kind} {name}")


def test_kept_scales_of_another_shape_are_refused():
    projector = Projector(ServedFormatSpec("mxfp4"))
    projector.project({"x.weight": torch.randn(8, 64)}, anchor=True)
    with pytest.raises(FailedPrecondition, match="anchor=True"):
        projector.project({"x.weight": torch.randn(8, 128)}, anchor=False)
    projector.project({"x.weight": torch.randn(8, 128)}, anchor=True)  # an anchor starts over


def test_resume_from_refuses_a_view_of_another_format():
    served = make_served_view("nvfp4", layers=1, hidden=128, intermediate=256, vocab=256)
    with pytest.raises(InvalidArgument, match="resume from a view"):
        Projector(ServedFormatSpec("mxfp4")).resume_from(served)


def test_make_served_view_is_deterministic():
    a = make_served_view("fp8_e4m3", layers=1, hidden=128, intermediate=256, vocab=256, seed=3)
    b = make_served_view("fp8_e4m3", layers=1, hidden=128, intermediate=256, vocab=256, seed=3)
    assert list(a) == list(b)
    for name in a:
        assert_bitwise(a[name], b[name], name)


# ---------------------------------------------------------------------------
# spec <-> proto
# ---------------------------------------------------------------------------


def test_spec_proto_roundtrip_and_defaults():
    for kind in KINDS:
        for granularity in (["tensor", "block128"] if kind.startswith("fp8") else ["tensor"]):
            for policy in ("fixed", "pow2", "recompute"):
                spec = ServedFormatSpec(kind, granularity, policy, ("*norm*",))
                assert ServedFormatSpec.from_proto(spec.to_proto()) == spec
    minimal = ServedFormatSpec.from_proto(pb.ServedFormat(kind=pb.FORMAT_KIND_NVFP4))
    assert minimal == ServedFormatSpec("nvfp4", "tensor", "fixed", ())
    assert ServedFormatSpec("bf16", keep_bf16_patterns=["a"]).keep_bf16_patterns == ("a",)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kind": "int4"}, "kind"),
        ({"kind": "mxfp4", "scale_granularity": "block128"}, "fp8 kinds only"),
        ({"kind": "fp8_e4m3", "scale_policy": "sometimes"}, "scale_policy"),
        ({"kind": "fp8_e4m3", "scale_granularity": "row"}, "scale_granularity"),
    ],
)
def test_spec_rejects_what_it_cannot_project(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        ServedFormatSpec(**kwargs)


def test_from_proto_rejects_unspecified_kind():
    with pytest.raises(InvalidArgument, match="unspecified"):
        ServedFormatSpec.from_proto(pb.ServedFormat())


# ---------------------------------------------------------------------------
# density counting
# ---------------------------------------------------------------------------


def test_transition_density_counts_raw_bit_changes():
    old = make_served_view("fp8_e4m3", layers=1, hidden=128, intermediate=256, vocab=256)
    new = {n: t.clone() for n, t in old.items()}
    q = "model.layers.0.self_attn.q_proj.weight"
    new[q].view(torch.uint8).view(-1)[:5] ^= 1
    new[q + "_scale"].mul_(2)
    new["model.norm.weight"].view(-1)[0] = -new["model.norm.weight"].view(-1)[0]
    changed, total, scale_changed = transition_density(old, new)
    assert (changed, scale_changed) == (7, 1)
    assert total == sum(t.numel() for t in old.values())
    zeros = {"z": torch.zeros(4)}
    assert transition_density(zeros, {"z": -torch.zeros(4)}).changed == 4  # -0.0 is a change
    nan = {"n": torch.full((3,), float("nan"))}
    assert transition_density(nan, {"n": nan["n"].clone()}).changed == 0  # same NaN bits are not
    with pytest.raises(InvalidArgument):
        transition_density(old, dict(list(new.items())[1:]))


# ---------------------------------------------------------------------------
# CUDA: the same bytes as on CPU
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,granularity", [("bf16", "tensor"), ("fp8_e4m3", "tensor"), ("fp8_e4m3", "block128"), ("fp8_e5m2", "tensor"), ("mxfp4", "tensor"), ("nvfp4", "tensor")])
@pytest.mark.parametrize("policy", ["fixed", "pow2", "recompute"])
def test_cuda_projection_matches_cpu_bytes(kind, granularity, policy):
    master = make_test_master(layers=1, hidden=256, intermediate=512, vocab=512, seed=11)
    spec = ServedFormatSpec(kind, granularity, policy)
    cpu, gpu = Projector(spec), Projector(spec)
    for step, m in enumerate([master, {n: t * 1.01 for n, t in master.items()}]):
        c = cpu.project(m, anchor=step == 0)
        g = gpu.project({n: t.cuda() for n, t in m.items()}, anchor=step == 0)
        for name in c:
            assert g[name].device.type == "cuda"
            assert_bitwise(g[name].cpu(), c[name], f"step {step} {name}")


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_a_strided_master_projects_to_contiguous_values_that_patches_apply_to(kind: str) -> None:
    """``Projector`` promises contiguous tensors: the per-tensor fp8 path kept a transposed
    master's strides, and patches refuse non-contiguous destinations."""
    from weftboard.cuda import formats
    from weftboard.cuda.codec import apply_patch_, encode_patch

    m = torch.randn(256, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    proj = formats.Projector(formats.ServedFormatSpec(kind))
    v1 = proj.project({"x.weight": m.t()}, anchor=True)
    v2 = proj.project({"x.weight": (m * 1.01).t()}, anchor=False)
    assert all(t.is_contiguous() for view in (v1, v2) for t in view.values())
    patch = encode_patch([(k, v1[k], v2[k]) for k in v1], base_version=1, target_version=2, target_root="")
    apply_patch_(v1, patch.data)
    assert all(torch.equal(v1[k].view(torch.uint8), v2[k].view(torch.uint8)) for k in v1)
