"""An island's copy of its run's model files (config, tokenizer: ``proto.model_files``).

``hold_model_files`` runs once per subscriber, before its first step, for a destination that
declares ``capabilities.holds_model_files`` (a checkpoint directory): it asks the board for
the run's files (``GetModelFiles``, with presigned URLs when the island has no blob-store
credentials), fetches those the destination lacks a verified copy of, and hands them over.

Invariants:
- A file the destination already holds with the right digest is not fetched again.
- Every fetched file's size and digest are checked by the fetcher before it is handed over;
  a mismatch raises ``DigestMismatch`` (a ``CorruptData``) and nothing of it is written to
  the destination (the destination hashes its own copies once more).
- The fetched copies leave the fetcher's cache once handed over, or after a failure.
"""

from __future__ import annotations

from typing import Any

from weftboard.proto.errors import CorruptData
from weftboard.proto.records import BlobRef
from weftboard.subscriber.destination import HoldsModelFiles
from weftboard.subscriber.fetch import Fetcher, fetch_all


async def hold_model_files(client: Any, run: str, destination: HoldsModelFiles, fetcher: Fetcher, *,
                           presign: bool) -> list[str]:
    """Give ``destination`` the run's model files; returns the names it had to fetch."""
    refs = await client.get_model_files(run, presign=presign)
    files = [BlobRef(r.key, r.digest, r.size, name=r.name) for r in refs]
    missing = set(await destination.missing_model_files(files))
    wanted = [r for r in refs if r.name in missing]

    async def fetch(ref: Any) -> Any:
        try:
            return await fetcher.fetch(ref)
        except CorruptData as exc:  # the same error, naming the file
            raise type(exc)(f"model file {ref.name!r} of run {run!r}: {exc}") from exc

    try:
        paths = await fetch_all([fetch(r) for r in wanted])
        await destination.hold_model_files(files, {r.name: p for r, p in zip(wanted, paths, strict=True)})
    finally:
        for r in wanted:
            fetcher.forget(r)
    return [r.name for r in wanted]
