"""Moving served slices to their owner ranks, point to point on the publisher's process group.

For one version, every rank sends the slices it is the sender of (``TensorPlan.slices``) to
each tensor's owner, one buffer per (sender, owner) pair holding its slices in layout order,
and receives the same from every other rank for the tensors it owns.

Invariants:
- Sizes and order come from the ``SlicePlan`` every rank computed identically, so no size is
  exchanged and a buffer's bytes split into slices without a header.
- An owner's assembled tensor equals the full logical served tensor: the slices tile it
  exactly (``plan_slices`` checked that), each written once at its box.
- A tensor the owner holds whole is taken from its snapshot; nothing moves for it.
- Every buffer sent or received is in host memory: the publisher's group is gloo, whose
  point-to-point calls take host tensors, so a slice on a GPU is copied down before it is sent.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from weftboard.publisher.sharded_layout import Box, SlicePlan


def _region(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(box[0], box[1], strict=True))]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in host memory, flat (a view when ``t`` is a contiguous host tensor)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def exchange_slices(plan: SlicePlan, rank: int, snapshot: dict[str, torch.Tensor],
                    group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """The full served tensors this rank owns, assembled from every rank's slices."""
    outgoing: dict[int, list[torch.Tensor]] = {}
    incoming: dict[int, list[tuple[str, Box]]] = {}
    owned: dict[str, torch.Tensor] = {}
    for t in plan.tensors:
        if t.owner == rank:
            if t.whole_on_owner:
                owned[t.name] = snapshot[t.name]
                continue
            full = torch.empty(t.shape, dtype=getattr(torch, t.dtype))
            owned[t.name] = full
            for sender, box in t.slices:
                if sender == rank:
                    _region(full, box).copy_(snapshot[t.name].reshape(box[1]))
                else:
                    incoming.setdefault(sender, []).append((t.name, box))
        elif not t.whole_on_owner and any(r == rank for r, _ in t.slices):
            outgoing.setdefault(t.owner, []).append(_bytes(snapshot[t.name]))
    peers = dist.get_process_group_ranks(group)
    requests = []
    for owner, pieces in outgoing.items():
        requests.append(dist.isend(torch.cat(pieces), peers[owner], group=group))
    buffers: dict[int, torch.Tensor] = {}
    for sender, slots in incoming.items():
        size = sum(math.prod(box[1]) * owned[name].element_size() for name, box in slots)
        buffers[sender] = torch.empty(size, dtype=torch.uint8)
        requests.append(dist.irecv(buffers[sender], peers[sender], group=group))
    for request in requests:
        request.wait()
    for sender, slots in incoming.items():
        at = 0
        for name, box in slots:
            full = owned[name]
            n = math.prod(box[1]) * full.element_size()
            _region(full, box).copy_(buffers[sender][at:at + n].view(full.dtype).reshape(box[1]))
            at += n
    return owned
