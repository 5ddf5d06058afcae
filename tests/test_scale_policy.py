"""Scale policies: kept scales keep patches sparse; moved scales move only where they must.

The density comparison runs real torch AdamW steps (lr 3e-6) and measures both policies on
the same steps; nothing here hard-codes a count.
"""

from __future__ import annotations

import math

import pytest
import torch

from weftboard.cuda import formats_fp4 as fp4
from weftboard.cuda.formats import (
    Projector,
    ServedFormatSpec,
    adamw_steps,
    changed_elements,
    make_test_master,
    transition_density,
)


def bf16_export(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a trainer hands to the serving side: its fp32 master cast to bf16."""
    return {name: t.to(torch.bfloat16) for name, t in master.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return int(changed_elements(a, b)) == 0 and a.shape == b.shape


# ---------------------------------------------------------------------------
# fixed vs recompute on realistic AdamW steps (fp8 per tensor)
# ---------------------------------------------------------------------------


def test_fixed_scales_make_adamw_patches_sparser_than_recomputed_scales():
    """lr 3e-6 AdamW steps on a bf16-exported model, fp8 e4m3 with per-tensor scales.

    Recompute moves a tensor's scale whenever its bf16 amax moves by one ulp, which rewrites
    a few percent of that tensor; "fixed" keeps the anchor's scale (the amax grew far less
    than the fp8 overflow margin) and the tensor changes only where Adam pushed values
    across an fp8 rounding boundary.
    """
    gen = torch.Generator().manual_seed(1)
    master = {f"model.layers.{i}.mlp.proj.weight": torch.randn(128, 128, generator=gen) * 0.02 for i in range(64)}
    policies = ("fixed", "recompute")
    projectors = {p: Projector(ServedFormatSpec("fp8_e4m3", "tensor", p)) for p in policies}
    exported = bf16_export(master)
    previous = {p: projectors[p].project(exported, anchor=True) for p in policies}
    totals = {p: [0, 0, 0] for p in policies}
    events = []  # (tensor, step, {policy: changed elements of that tensor})
    for step, state in enumerate(adamw_steps(master, 16, lr=3e-6, seed=2)):
        current_export = bf16_export(state)
        current = {p: projectors[p].project(current_export, anchor=False) for p in policies}
        for p in policies:
            density = transition_density(previous[p], current[p])
            totals[p] = [t + d for t, d in zip(totals[p], density)]
        for name in master:
            if not torch.equal(exported[name].abs().max(), current_export[name].abs().max()):
                events.append(
                    (name, step, {p: int(changed_elements(previous[p][name], current[p][name])) for p in policies})
                )
        previous, exported = current, current_export

    assert events, "no tensor's bf16 amax moved in 16 steps; the comparison would measure nothing"
    for name, step, changed in events:
        assert changed["recompute"] >= 3 * changed["fixed"], (name, step, changed)
    fixed_changed, _, fixed_scale_changed = totals["fixed"]
    recompute_changed, _, recompute_scale_changed = totals["recompute"]
    assert fixed_scale_changed == 0  # no step came near the overflow margin
    assert recompute_scale_changed >= len(events)
    assert fixed_changed < recompute_changed


# ---------------------------------------------------------------------------
# "fixed": what moves and what stays
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fixed_block128_moves_only_the_overflowing_block(dtype_kind):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(256, 384, generator=gen) * 0.02
    projector = Projector(ServedFormatSpec(dtype_kind, "block128", "fixed"))
    first = projector.project({"w.weight": x}, anchor=True)
    y = x.clone()
    y[5, 200] = x[:128, 128:256].abs().max() * 4  # block (0, 1) overflows
    y[200, 10] *= 0.5  # block (1, 0) shrinks: kept
    second = projector.project({"w.weight": y}, anchor=False)
    s0, s1 = first["w.weight_scale_inv"], second["w.weight_scale_inv"]
    moved = (s0.view(torch.int32) != s1.view(torch.int32)).nonzero().tolist()
    assert moved == [[0, 1]]
    fresh = Projector(ServedFormatSpec(dtype_kind, "block128", "recompute")).project({"w.weight": y}, anchor=True)
    assert s1[0, 1].item() == fresh["w.weight_scale_inv"][0, 1].item()
    # values change only inside the moved block and at the element that changed elsewhere
    diff = (first["w.weight"].view(torch.uint8) != second["w.weight"].view(torch.uint8)).nonzero().tolist()
    assert all((r < 128 and 128 <= c < 256) or (r, c) == (200, 10) for r, c in diff)


def test_fixed_per_tensor_keeps_scale_within_the_rounding_margin():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=gen)
    projector = Projector(ServedFormatSpec("fp8_e4m3", "tensor", "fixed"))
    first = projector.project({"w.weight": x}, anchor=True)
    kept = first["w.weight_scale"].clone()
    grown = x * 1.03  # the max scaled value becomes ~461, still rounds to 448: no overflow
    assert same_bits(projector.project({"w.weight": grown}, anchor=False)["w.weight_scale"], kept)
    overflowing = x * 1.05  # ~470 would round past 448
    moved = projector.project({"w.weight": overflowing}, anchor=False)["w.weight_scale"]
    assert moved.item() == pytest.approx(float(overflowing.abs().max()) / 448.0, rel=1e-7)
    # an anchor recomputes even when nothing overflows
    shrunk = x * 0.5
    anchored = projector.project({"w.weight": shrunk}, anchor=True)["w.weight_scale"]
    assert anchored.item() == pytest.approx(float(shrunk.abs().max()) / 448.0, rel=1e-7)
    kept_after_shrink = projector.project({"w.weight": shrunk * 0.5}, anchor=False)["w.weight_scale"]
    assert same_bits(kept_after_shrink, anchored)


def test_fixed_mxfp4_moves_only_blocks_that_outgrow_their_exponent():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 128, generator=gen) * 0.02
    projector = Projector(ServedFormatSpec("mxfp4", scale_policy="fixed"))
    first = projector.project({"w.weight": x}, anchor=True)
    y = x.clone()
    y[2, 70] = x[2, 64:96].abs().max() * 2.5  # block (2, 2) needs a larger exponent
    y[0, 5] = 0.0
    y[1] *= 0.1  # every block of row 1 shrinks: kept
    second = projector.project({"w.weight": y}, anchor=False)
    moved = (first["w.weight_scale"] != second["w.weight_scale"]).nonzero().tolist()
    assert moved == [[2, 2]]
    assert second["w.weight_scale"][2, 2] == fp4.mxfp4_fresh_scales(y)[2, 2]


def test_fixed_nvfp4_moves_a_block_then_the_tensor_scale_only_when_needed():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 64, generator=gen) * 0.02
    x[0, 0] = 0.2  # an outlier sets the tensor scale, as in trained weights
    projector = Projector(ServedFormatSpec("nvfp4", scale_policy="fixed"))
    first = projector.project({"w.weight": x}, anchor=True)
    block_amax = x.abs().reshape(8, 4, 16).amax(-1)
    row, col = divmod(int(block_amax.argmin()), 4)  # a quiet block: tripled, it stays under the tensor amax
    assert block_amax[row, col] * 3 < x.abs().max()
    y = x.clone()
    y[row, col * 16 + 5] = block_amax[row, col] * 3  # overflows that block's kept scale only
    second = projector.project({"w.weight": y}, anchor=False)
    assert same_bits(second["w.weight_scale_2"], first["w.weight_scale_2"])
    moved = (first["w.weight_scale"].view(torch.uint8) != second["w.weight_scale"].view(torch.uint8)).nonzero().tolist()
    assert moved == [[row, col]]
    z = y.clone()
    z[6, 50] = x.abs().max() * 1000  # no e4m3 block scale can hold this under the kept tensor scale
    third = projector.project({"w.weight": z}, anchor=False)
    fresh = Projector(ServedFormatSpec("nvfp4", scale_policy="recompute")).project({"w.weight": z}, anchor=True)
    for name in fresh:
        assert same_bits(third[name], fresh[name]), name


def test_fixed_recovers_from_a_nan_block():
    x = torch.randn(2, 64)
    projector = Projector(ServedFormatSpec("mxfp4", scale_policy="fixed"))
    projector.project({"w.weight": x}, anchor=True)
    poisoned = x.clone()
    poisoned[1, 40] = float("nan")
    nan_view = projector.project({"w.weight": poisoned}, anchor=False)
    assert nan_view["w.weight_scale"][1, 1].item() == fp4.E8M0_NAN
    healed = projector.project({"w.weight": x}, anchor=False)
    assert healed["w.weight_scale"][1, 1] == fp4.mxfp4_fresh_scales(x)[1, 1]


def test_a_tensor_seen_first_without_an_anchor_gets_fresh_scales():
    x = torch.randn(16, 64)
    fixed = Projector(ServedFormatSpec("nvfp4", scale_policy="fixed")).project({"w.weight": x}, anchor=False)
    fresh = Projector(ServedFormatSpec("nvfp4", scale_policy="recompute")).project({"w.weight": x}, anchor=True)
    for name in fresh:
        assert same_bits(fixed[name], fresh[name]), name


# ---------------------------------------------------------------------------
# restart: resume_from restores the state bit for bit
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,granularity", [("fp8_e4m3", "tensor"), ("fp8_e5m2", "block128"), ("mxfp4", "tensor"), ("nvfp4", "tensor")]
)
def test_a_restarted_publisher_projects_the_same_versions(kind, granularity):
    master = make_test_master(layers=1, hidden=128, intermediate=256, vocab=256, seed=12)
    spec = ServedFormatSpec(kind, granularity, "fixed")
    running = Projector(spec)
    views = [running.project(master, anchor=True)]
    states = list(adamw_steps(master, 3, lr=3e-6, seed=13))
    states[1]["model.layers.0.mlp.up_proj.weight"][0, 0] = 5.0  # force a scale to move mid-run
    for state in states:
        views.append(running.project(state, anchor=False))
    for restart_after in range(1, len(views)):
        restarted = Projector(spec)
        restarted.resume_from(views[restart_after - 1])
        replayed = restarted.project(states[restart_after - 1], anchor=False)
        for name, tensor in views[restart_after].items():
            assert same_bits(replayed[name], tensor), (restart_after, name)


# ---------------------------------------------------------------------------
# pow2 and recompute are stateless
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,granularity", [("fp8_e4m3", "tensor"), ("fp8_e4m3", "block128"), ("mxfp4", "tensor"), ("nvfp4", "tensor")]
)
@pytest.mark.parametrize("policy", ["pow2", "recompute"])
def test_stateless_policies_depend_only_on_current_values(kind, granularity, policy):
    master = make_test_master(layers=1, hidden=128, intermediate=256, vocab=256, seed=14)
    spec = ServedFormatSpec(kind, granularity, policy)
    running = Projector(spec)
    running.project(master, anchor=True)
    state = next(adamw_steps(master, 1, lr=1e-3, seed=15))
    continued = running.project(state, anchor=False)
    fresh = Projector(spec).project(state, anchor=True)
    for name in fresh:
        assert same_bits(continued[name], fresh[name]), name
    if policy == "pow2":
        for name, tensor in fresh.items():
            if name.endswith(("_scale", "_scale_inv", "_scale_2")) and tensor.dtype != torch.uint8:
                mantissa, _ = torch.frexp(tensor.float())
                assert torch.all(mantissa == 0.5), name


def test_pow2_fp8_scale_is_the_next_power_of_two_above_the_fresh_scale():
    x = torch.randn(32, 32)
    served = Projector(ServedFormatSpec("fp8_e4m3", scale_policy="pow2")).project({"w.weight": x}, anchor=True)
    fresh = float(x.abs().max()) / 448.0
    assert served["w.weight_scale"].item() == 2.0 ** math.ceil(math.log2(fresh))
    assert served["w.weight"].float().abs().max().item() <= 448.0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_overflow_margin_is_where_round_to_nearest_even_leaves_the_range(dtype):
    """The "fixed" policy's overflow test agrees with RNE in an unbounded exponent range.

    e5m2: torch's own cast turns exactly those values into Inf. e4m3fn: torch saturates them
    at 448, so the reference rounds to e4m3's spacing at the top binade (32) half-to-even.
    """
    from weftboard.cuda.formats_fp8 import fp8_overflows

    fmax = torch.finfo(dtype).max
    probe = torch.linspace(fmax, fmax * 1.2, 4097, dtype=torch.float32)
    midpoint = fmax * (1 + 2.0 ** -(4 if dtype == torch.float8_e4m3fn else 3))
    probe = torch.cat([probe, torch.tensor([midpoint, midpoint * (1 + 2.0**-20), midpoint * (1 - 2.0**-20)])])
    if dtype == torch.float8_e5m2:
        leaves_range = torch.isinf(probe.to(dtype).float())
    else:
        leaves_range = torch.round(probe / 32.0) * 32.0 > fmax  # torch.round is half-to-even
    assert leaves_range.any() and not leaves_range.all()
    assert torch.equal(fp8_overflows(probe, dtype), leaves_range)


def test_kept_scales_do_not_alias_the_returned_view():
    """A publisher or engine may patch its served view in place; the kept state must not move."""
    x = torch.randn(32, 64)
    projector = Projector(ServedFormatSpec("nvfp4", scale_policy="fixed"))
    first = projector.project({"w.weight": x}, anchor=True)
    expected = Projector(ServedFormatSpec("nvfp4", scale_policy="fixed"))
    expected.resume_from({n: t.clone() for n, t in first.items()})
    first["w.weight_scale"].view(torch.uint8).fill_(0x38)  # scribble over the returned scales
    first["w.weight_scale_2"].fill_(123.0)
    got = projector.project({"w.weight": x}, anchor=False)
    want = expected.project({"w.weight": x}, anchor=False)
    for name in want:
        assert same_bits(got[name], want[name]), name
