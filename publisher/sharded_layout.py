"""Which rank holds which slice of which tensor, checked across ranks: the sharded publisher's plan.

Every rank of a sharded publisher describes what it holds (``RankHeader``): each tensor's name,
dtype and full (logical) shape, and the box (offset and shape) of its slice, or the whole
tensor. ``plan_slices`` checks the ranks' descriptions against each other and returns one
``SlicePlan`` that every rank computes identically from the same gathered headers:

- ranks agree on the world size, the version being published and every tensor's name, dtype
  and logical shape, else ``InvalidArgument`` names the first disagreement;
- ranks agree on the training step of the version (``step``; None in the setup headers), else
  ``InvalidArgument`` names each step and the ranks at it: a version never pairs two steps;
- a tensor's slices tile it exactly: no two distinct boxes overlap and together they cover
  every element (else ``InvalidArgument`` naming the overlap or the missing count);
- identical boxes held by several ranks (replicated tensors, or replicas along a mesh dim)
  are one slice, sent by the lowest rank holding it: each element is published once;
- each tensor has one owner rank, which assembles it whole, diffs, encodes, hashes and uploads
  it; a tensor held whole by some rank is owned by one of those ranks (nothing moves), and
  owners are balanced by bytes, in layout order (deterministic, so every rank agrees).

Pure: no torch.distributed, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from weftboard.proto.errors import InvalidArgument

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) inside the logical tensor


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as one rank holds it: ``box`` is None for the whole tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    box: Box | None
    itemsize: int = 2


@dataclass(frozen=True)
class RankHeader:
    rank: int
    world: int
    version: int
    entries: tuple[TensorEntry, ...]
    step: int | None = None  # the trainer's step of this version (None: no version, the setup)


@dataclass
class TensorPlan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    owner: int
    slices: list[tuple[int, Box]] = field(default_factory=list)  # (sending rank, box), deduplicated
    whole_on_owner: bool = False  # the owner holds the whole tensor: nothing is exchanged for it


@dataclass
class SlicePlan:
    world: int
    tensors: list[TensorPlan]

    def owned_by(self, rank: int) -> list[TensorPlan]:
        return [t for t in self.tensors if t.owner == rank]


def full_box(shape: tuple[int, ...]) -> Box:
    return (tuple(0 for _ in shape), tuple(shape))


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True))


def _check_box(name: str, rank: int, shape: tuple[int, ...], box: Box) -> None:
    offset, size = box
    if len(offset) != len(shape) or len(size) != len(shape) or any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(offset, size, shape, strict=True)):
        raise InvalidArgument(f"rank {rank}'s slice of {name!r} (offset {list(offset)}, shape {list(size)}) "
                              f"does not fit inside its logical shape {list(shape)}")


def plan_slices(headers: list[RankHeader]) -> SlicePlan:
    """The checked plan for these headers (one per rank, in rank order)."""
    world = len(headers)
    for i, h in enumerate(headers):
        if h.rank != i:
            raise InvalidArgument(f"header {i} comes from rank {h.rank}: ranks must be 0..{world - 1}")
        if h.world != world:
            raise InvalidArgument(f"world size changed mid-version: rank {i} publishes for a world of {h.world} "
                                  f"ranks, but {world} ranks take part in version {headers[0].version}")
        if h.version != headers[0].version:
            raise InvalidArgument(f"ranks disagree on the version being published: rank 0 publishes version "
                                  f"{headers[0].version}, rank {i} version {h.version} (the ranks' publishers "
                                  f"did not open the run together)")
    steps: dict[int | None, list[int]] = {}
    for h in headers:
        steps.setdefault(h.step, []).append(h.rank)
    if len(steps) > 1:
        detail = "; ".join(f"step {s} on rank(s) {ranks}" for s, ranks in steps.items())
        raise InvalidArgument(f"ranks disagree on the training step of version {headers[0].version}: {detail} "
                              f"(a rank skipped or repeated a publish): the version is refused on every rank")
    first = [(e.name, e.dtype, e.shape) for e in headers[0].entries]
    for h in headers[1:]:
        theirs = [(e.name, e.dtype, e.shape) for e in h.entries]
        if theirs != first:
            diff = next(((a, b) for a, b in zip(first, theirs, strict=False) if a != b), None)
            detail = (f"rank 0 has {diff[0]}, rank {h.rank} has {diff[1]}" if diff is not None else
                      f"rank 0 has {len(first)} tensors, rank {h.rank} has {len(theirs)}")
            raise InvalidArgument(f"ranks disagree on the layout: {detail}")
    load = [0] * world
    plans: list[TensorPlan] = []
    for i, (name, dtype, shape) in enumerate(first):
        itemsize = headers[0].entries[i].itemsize
        slices: list[tuple[int, Box]] = []
        for h in headers:
            box = h.entries[i].box or full_box(shape)
            _check_box(name, h.rank, shape, box)
            if math.prod(box[1]) == 0 or any(b == box for _, b in slices):
                continue  # empty, or a replica of a slice a lower rank sends
            for r, other in slices:
                if _overlap(box, other):
                    raise InvalidArgument(
                        f"overlapping slices of {name!r}: rank {r} holds offset {list(other[0])} shape "
                        f"{list(other[1])}, rank {h.rank} offset {list(box[0])} shape {list(box[1])}")
            slices.append((h.rank, box))
        covered, numel = sum(math.prod(b[1]) for _, b in slices), math.prod(shape)
        if covered != numel:
            raise InvalidArgument(f"missing slices of {name!r}: the ranks' slices cover {covered} of its "
                                  f"{numel} elements (logical shape {list(shape)})")
        whole = [h.rank for h in headers if (h.entries[i].box or full_box(shape)) == full_box(shape)]
        candidates = whole or list(range(world))
        owner = min(candidates, key=lambda r: (load[r], r))
        load[owner] += numel * itemsize
        plans.append(TensorPlan(name, dtype, tuple(shape), owner, slices, bool(whole)))
    return SlicePlan(world, plans)
