"""The pure domain core: names, digests, catch-up plans and version constraints."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weftboard.proto import errors
from weftboard.proto.domain import (
    Plan,
    StepKind,
    VersionArtifacts,
    VersionConstraint,
    blob_key,
    check_digest,
    check_name,
    format_digest,
    plan_catch_up,
)
from weftboard.proto.plans import needs_older


@pytest.mark.parametrize("name", ["run1", "a", "Run-2.b_c", "0" * 64])
def test_valid_names(name: str) -> None:
    assert check_name("run", name) == name


@pytest.mark.parametrize("name", ["", "-x", ".x", "a/b", "a b", "x" * 65, "é", "run\n", "run\r\n", "\nrun"])
def test_invalid_names_say_which_field(name: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="island_id"):
        check_name("island_id", name)


def test_digest_round_trip_and_key() -> None:
    digest = format_digest(bytes(range(16)))
    assert check_digest("d", digest) == digest
    assert blob_key("r1", digest) == "r1/blobs/000102030405060708090a0b0c0d0e0f"
    for bad in ["xxh3-128:ABC", "sha256:" + "0" * 32, "xxh3-128:" + "0" * 31, digest + "\n"]:
        with pytest.raises(errors.InvalidArgument):
            check_digest("d", bad)


def _chain(n: int, anchors: set[int], patch: int = 10, anchor: int = 1000) -> dict[int, VersionArtifacts]:
    return {
        v: VersionArtifacts(v, None if v == 1 else patch, anchor if v in anchors else None) for v in range(1, n + 1)
    }


def test_plan_prefers_patches_from_what_the_island_has() -> None:
    plan = plan_catch_up(have=3, want=0, head=6, oldest_available=1, artifacts=_chain(6, {1, 4}))
    assert [(s.kind, s.from_version, s.to_version) for s in plan.steps] == [
        (StepKind.PATCH, 3, 4),
        (StepKind.PATCH, 4, 5),
        (StepKind.PATCH, 5, 6),
    ]
    assert plan.total_bytes == 30


def test_plan_for_a_newcomer_starts_at_the_nearest_anchor() -> None:
    plan = plan_catch_up(have=0, want=6, head=6, oldest_available=1, artifacts=_chain(6, {1, 4}))
    assert plan.steps[0].kind is StepKind.ANCHOR and plan.steps[0].to_version == 4
    assert [s.to_version for s in plan.steps] == [4, 5, 6]


def test_plan_going_back_uses_an_anchor() -> None:
    plan = plan_catch_up(have=6, want=2, head=6, oldest_available=1, artifacts=_chain(6, {1, 4}))
    assert [s.to_version for s in plan.steps] == [1, 2]


def test_plan_takes_an_anchor_when_patches_cost_more() -> None:
    arts = _chain(6, {1, 5}, patch=600)
    plan = plan_catch_up(have=1, want=6, head=6, oldest_available=1, artifacts=arts)
    assert [s.kind for s in plan.steps] == [StepKind.ANCHOR, StepKind.PATCH]


def test_plan_errors_name_the_problem() -> None:
    arts = _chain(6, {1})
    with pytest.raises(errors.OutOfRange, match="beyond the head"):
        plan_catch_up(0, 9, 6, 1, arts)
    with pytest.raises(errors.OutOfRange, match="oldest available version is 3"):
        plan_catch_up(0, 2, 6, 3, arts)
    with pytest.raises(errors.FailedPrecondition, match="no retained chain"):
        plan_catch_up(0, 6, 6, 3, arts)  # anchor 1 was collected
    with pytest.raises(errors.FailedPrecondition, match="no committed version"):
        plan_catch_up(0, 0, 0, 0, {})
    assert plan_catch_up(4, 4, 6, 1, arts) == Plan(4, 4, ())


def _brute_force(have: int, target: int, oldest: int, arts: dict[int, VersionArtifacts]) -> int | None:
    """Cheapest byte count over every start: enumerates instead of using suffix sums."""
    best = None
    # An island may hold a collected version: the patch of `oldest` still applies to it.
    starts = [(have, 0)] if 0 < have <= target and have >= oldest - 1 else []
    starts += [(v, arts[v].anchor_bytes) for v in range(oldest, target + 1) if arts[v].anchor_bytes is not None]
    for start, cost in starts:
        patches = [arts[v].patch_bytes for v in range(start + 1, target + 1)]
        if any(p is None for p in patches):
            continue
        total = cost + sum(patches)
        best = total if best is None else min(best, total)
    return best


def _draw_history(n: int, data: st.DataObject) -> dict[int, VersionArtifacts]:
    """Versions 1..n, each with or without a patch (never version 1) and an anchor."""
    arts = {}
    for v in range(1, n + 1):
        patch = None if v == 1 else data.draw(st.one_of(st.none(), st.integers(1, 500)), label=f"patch{v}")
        anchor = data.draw(st.one_of(st.none(), st.integers(1, 2000)), label=f"anchor{v}")
        arts[v] = VersionArtifacts(v, patch, anchor)
    return arts


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 12),
    data=st.data(),
)
def test_plan_is_the_cheapest_chain(n: int, data: st.DataObject) -> None:
    arts = _draw_history(n, data)
    oldest = data.draw(st.integers(1, n), label="oldest")
    have = data.draw(st.integers(0, n), label="have")
    want = data.draw(st.integers(oldest, n), label="want")
    expected = 0 if have == want else _brute_force(have, want, oldest, arts)
    if expected is None:
        with pytest.raises(errors.FailedPrecondition):
            plan_catch_up(have, want, n, oldest, arts)
        return
    plan = plan_catch_up(have, want, n, oldest, arts)
    assert plan.total_bytes == expected
    # The steps form a chain ending at the target, starting from `have` or an anchor.
    position = have
    for step in plan.steps:
        if step.kind is StepKind.ANCHOR:
            position = step.to_version
        else:
            assert step.from_version == position
            position = step.to_version
    assert position == want


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 40), chunk=st.integers(1, 8), data=st.data())
def test_a_plan_from_the_index_read_down_in_chunks_is_the_whole_indexs(n: int, chunk: int,
                                                                      data: st.DataObject) -> None:
    """The board reads the index from the target down, ``chunk`` versions at a time, until
    ``needs_older`` says no older start can win: the plan from what it read is the plan from
    the whole history."""
    arts = _draw_history(n, data)
    oldest = data.draw(st.integers(1, n), label="oldest")
    have = data.draw(st.integers(0, n), label="have")
    target = data.draw(st.integers(oldest, n), label="want")
    window: dict[int, VersionArtifacts] = {}
    hi = target
    while hi >= oldest:
        lo = max(oldest, hi - chunk + 1)
        window.update((v, arts[v]) for v in range(lo, hi + 1))
        hi = lo - 1
        if not needs_older(have, target, window, lo):
            break
    try:
        whole = plan_catch_up(have, target, n, oldest, arts)
    except errors.FailedPrecondition:
        with pytest.raises(errors.FailedPrecondition):
            plan_catch_up(have, target, n, oldest, window)
        return
    assert plan_catch_up(have, target, n, oldest, window) == whole


@pytest.mark.parametrize(
    "text,version,head,ok",
    [
        ("exact=7", 7, 9, True),
        ("exact=7", 8, 9, False),
        ("min=5", 5, 9, True),
        ("min=5", 4, 9, False),
        ("max_staleness=2", 7, 9, True),
        ("max_staleness=2", 6, 9, False),
        ("min=5, max_staleness=1", 8, 9, True),
        ("", 1, 9, True),
        ("", 0, 9, False),
    ],
)
def test_constraints(text: str, version: int, head: int, ok: bool) -> None:
    assert VersionConstraint.parse(text).accepts(version, head) is ok


@pytest.mark.parametrize("text", ["exact", "exact=x", "newest=3", "exact=0", "min=-1"])
def test_bad_constraints_are_rejected_with_a_reason(text: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        VersionConstraint.parse(text)


def test_error_codes_round_trip() -> None:
    for cls in (errors.Aborted, errors.NotFound, errors.OutOfRange, errors.Unavailable):
        err = errors.from_status_code(cls.grpc_code_name, "m")
        assert type(err) is cls and str(err) == "m"
    assert isinstance(errors.DigestMismatch("x"), errors.CorruptData)
