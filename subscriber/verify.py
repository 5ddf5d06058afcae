"""Verifying served tensors against a version record before anyone sees them.

Invariants:
- The layout must match the target's exactly (names, dtypes, shapes); a mismatch is
  ``ApplyError`` (wrong destination for this run), not a digest problem.
- Every tensor's digest is compared to the record's, and the root digest is recomputed
  from the layout and those digests and compared to the record's root, so a record whose
  tensor digests were tampered with cannot pass either.
- Only tensors named in ``rehash`` are hashed; the others come from ``cache`` (digests the
  destination computed when it last verified them), which keeps the check of a patch that changed few tensors
  proportional to the tensors it touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.proto.errors import ApplyError, DigestMismatch
from weftboard.subscriber.destination import VersionTarget


def check_layout(tensors: Mapping[str, torch.Tensor], target: VersionTarget) -> None:
    if len(tensors) != len(target.layout):
        extra = sorted(set(tensors) - {e.name for e in target.layout})[:3]
        missing = sorted({e.name for e in target.layout} - set(tensors))[:3]
        raise ApplyError(
            f"version {target.version}: the destination holds {len(tensors)} tensors, the layout has "
            f"{len(target.layout)} (missing {missing}, unexpected {extra})"
        )
    for e in target.layout:
        t = tensors.get(e.name)
        if t is None:
            raise ApplyError(f"version {target.version}: tensor {e.name!r} of the layout is missing")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
            raise ApplyError(
                f"version {target.version}: tensor {e.name!r} is {dtype}{list(t.shape)}, "
                f"the layout says {e.dtype}{list(e.shape)}"
            )


def verify_tensors(
    tensors: Mapping[str, torch.Tensor],
    target: VersionTarget,
    *,
    rehash: Iterable[str] | None = None,
    cache: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Digests of every layout tensor, verified against ``target``; DigestMismatch otherwise."""
    check_layout(tensors, target)
    todo = set(rehash) if rehash is not None else None
    names = [e.name for e in target.layout
             if todo is None or e.name in todo or cache is None or e.name not in cache]
    digests: dict[str, str] = {}
    if len(names) > 1:  # xxh3 releases the GIL: two threads
        with ThreadPoolExecutor(2, thread_name_prefix="weftboard-verify") as pool:
            digests.update(zip(names, pool.map(lambda n: tensor_digest(tensors[n]), names), strict=True))
    else:
        digests.update((n, tensor_digest(tensors[n])) for n in names)
    for e in target.layout:
        if e.name not in digests:
            digests[e.name] = cache[e.name]  # type: ignore[index]
        want = target.tensor_digests.get(e.name)
        if digests[e.name] != want:
            raise DigestMismatch(
                f"version {target.version}: tensor {e.name!r} hashes to {digests[e.name]}, "
                f"the record says {want}; the result is not served"
            )
    root = root_digest([(e.name, e.dtype, list(e.shape), digests[e.name]) for e in target.layout])
    if root != target.root_digest:
        raise DigestMismatch(
            f"version {target.version}: root digest {root} differs from the record's {target.root_digest}"
        )
    return digests
