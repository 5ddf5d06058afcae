"""The pure anchor policy: first version, every K, patch bytes over a fraction, no base."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weftboard.publisher.policy import AnchorPolicy, AnchorReason, decide_anchor


def test_first_version_is_an_anchor() -> None:
    d = decide_anchor(AnchorPolicy(10, 0.5), version=1, last_anchor_version=0, patch_bytes_since_anchor=0, anchor_bytes=100)
    assert d.anchor and d.reason is AnchorReason.FIRST


def test_every_k_versions_counted_from_last_anchor() -> None:
    policy = AnchorPolicy(anchor_every=3, patch_fraction=10.0)
    anchors = []
    last = 0
    for v in range(1, 11):
        d = decide_anchor(policy, version=v, last_anchor_version=last, patch_bytes_since_anchor=1, anchor_bytes=100)
        if d:
            anchors.append(v)
            last = v
    assert anchors == [1, 4, 7, 10]


def test_patch_bytes_over_fraction_triggers_anchor() -> None:
    policy = AnchorPolicy(anchor_every=1000, patch_fraction=0.5)
    below = decide_anchor(policy, version=5, last_anchor_version=1, patch_bytes_since_anchor=50, anchor_bytes=100)
    above = decide_anchor(policy, version=5, last_anchor_version=1, patch_bytes_since_anchor=51, anchor_bytes=100)
    assert not below
    assert above.anchor and above.reason is AnchorReason.PATCH_BYTES


def test_no_base_and_adapter_force_anchor() -> None:
    policy = AnchorPolicy(anchor_every=1000, patch_fraction=0.5)
    assert decide_anchor(policy, version=7, last_anchor_version=1, patch_bytes_since_anchor=0, anchor_bytes=100, has_base=False).reason is AnchorReason.NO_BASE
    assert decide_anchor(policy, version=7, last_anchor_version=6, patch_bytes_since_anchor=0, anchor_bytes=100, adapter=True).reason is AnchorReason.ADAPTER


def test_invalid_policy_rejected() -> None:
    with pytest.raises(ValueError):
        AnchorPolicy(anchor_every=0)
    with pytest.raises(ValueError):
        AnchorPolicy(patch_fraction=0)
    with pytest.raises(ValueError):
        decide_anchor(AnchorPolicy(), version=0, last_anchor_version=0, patch_bytes_since_anchor=0, anchor_bytes=1)


@given(
    k=st.integers(1, 20),
    frac=st.floats(0.01, 5.0),
    sizes=st.lists(st.integers(0, 200), min_size=1, max_size=60),
)
def test_simulated_history_bounds(k: int, frac: float, sizes: list[int]) -> None:
    """Replaying a history: a joiner never replays K or more patches, and never more
    patch bytes than the fraction allows (counting the version that crosses it)."""
    policy = AnchorPolicy(k, frac)
    anchor_bytes = 1000
    last, since = 0, 0
    for v, size in enumerate(sizes, start=1):
        d = decide_anchor(policy, version=v, last_anchor_version=last, patch_bytes_since_anchor=since + size, anchor_bytes=anchor_bytes)
        if d:
            last, since = v, 0
        else:
            since += size
            assert v - last < k
            assert since <= frac * anchor_bytes
    assert last >= 1
