"""Destination tensors that share memory: a tensor under two names (tied weights handed over
as ``model.state_dict()``) takes a patch that names both once, whole or while it arrives; tensors
that overlap in part are refused before any write."""

from __future__ import annotations

import pytest
import torch

from weftboard.cuda.codec import apply_patch_, apply_patch_arriving_, encode_patch
from weftboard.proto.errors import InvalidArgument
from weftboard.subscriber.arriving import ArrivingBytes


def _pair(n: int = 70_000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g).to(torch.bfloat16)
    new = old.clone()
    idx = torch.randperm(n, generator=g)[: n // 10]
    new[idx] = (new[idx].float() * 1.01 + 1e-3).to(torch.bfloat16)  # a tenth changes, by an ulp or more
    return old, new


def _patch(old: torch.Tensor, new: torch.Tensor, encoding: str) -> bytes:
    return bytes(encode_patch([("embed", old, new), ("lm_head", old, new)], base_version=1, target_version=2,
                              target_root=b"\0" * 32, encoding=encoding).data)


@pytest.mark.parametrize("arriving", [False, True])
@pytest.mark.parametrize("encoding", ["default", "compact", "baseline"])
def test_a_tensor_under_two_names_takes_the_patch_once(encoding: str, arriving: bool) -> None:
    old, new = _pair()
    data = _patch(old, new, encoding)
    tied = old.clone()
    tensors = {"embed": tied, "lm_head": tied}
    if arriving:
        blob = ArrivingBytes(len(data))
        blob.put(0, data)
        told: list[str] = []
        applied = apply_patch_arriving_(tensors, [blob], on_tensor=told.append, timeout_s=5)
        assert sorted(told) == ["embed", "lm_head"]  # both rehashed by a destination: both are new
    else:
        applied = apply_patch_(tensors, data)
    assert torch.equal(tied.view(torch.int16), new.view(torch.int16))
    applied.revert()
    assert torch.equal(tied.view(torch.int16), old.view(torch.int16))


def test_tensors_that_overlap_in_part_are_refused_before_any_write() -> None:
    old, new = _pair()
    base = torch.cat([old, old[:1000]])
    before = base.clone()
    tensors = {"embed": base[:70_000], "lm_head": base[1000:71_000]}
    with pytest.raises(InvalidArgument, match="overlap in memory"):
        apply_patch_(tensors, _patch(old, new, "default"))
    assert torch.equal(base.view(torch.int16), before.view(torch.int16))
