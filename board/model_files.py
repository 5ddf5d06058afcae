"""The board's side of a run's model files (config, tokenizer: ``proto.model_files``).

Invariants:
- They are stored with the run (its ``Run`` message in Redis), in name order, without URLs,
  and never change: CreateRun with other files for an existing run is refused.
- Version 1 of a run commits only once every model file is in the blob store with its
  declared size, so an island that sees a version finds the run's files too.
- Garbage collection never deletes them (``keys``), whatever versions it collects.
- Presigned GET URLs for them are made on request (GetModelFiles, an island's call), never
  stored.
"""

from __future__ import annotations

import asyncio
from typing import Any

from weftboard.proto.errors import FailedPrecondition
from weftboard.proto.v1 import board_pb2 as pb


def canonicalize(run: pb.Run) -> None:
    """Put ``run``'s model files in name order, URLs cleared (what the board stores)."""
    files = [pb.BlobRef(key=f.key, digest=f.digest, size=f.size, name=f.name)
             for f in sorted(run.model_files, key=lambda f: f.name)]
    del run.model_files[:]
    run.model_files.extend(files)


def keys(run: pb.Run) -> set[str]:
    """The blob keys of ``run``'s model files (garbage collection keeps them)."""
    return {f.key for f in run.model_files}


async def check_stored(blobs: Any, run: pb.Run) -> None:
    """Every model file of ``run`` is in the blob store with its size, else FAILED_PRECONDITION."""
    sizes = await asyncio.gather(*(blobs.stat(f.key) for f in run.model_files))
    for f, size in zip(run.model_files, sizes, strict=True):
        if size != f.size:
            found = "does not exist" if size is None else f"has {size} bytes, not {f.size}"
            raise FailedPrecondition(
                f"model file {f.name!r} of run {run.run!r} (blob {f.key!r}) {found} in {blobs.describe()}; "
                "upload the run's model files before committing version 1"
            )


async def presigned(blobs: Any, run: pb.Run, expires_s: int) -> list[pb.BlobRef]:
    """``run``'s model files with presigned GET URLs (url "" where the store cannot presign,
    as in a catch-up plan)."""
    urls = await asyncio.gather(*(blobs.presign_get(f.key, expires_s) for f in run.model_files))
    return [pb.BlobRef(key=f.key, digest=f.digest, size=f.size, name=f.name, url=url or "")
            for f, url in zip(run.model_files, urls, strict=True)]
