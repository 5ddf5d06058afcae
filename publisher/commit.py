"""Committing one version after its snapshot: encode what is left, upload, commit.

``commit_job`` runs these steps for one ``Job``, in order:

1. wait for the patch's streams (encoded during the read, the rest by ``encode_streams``
   on the publisher's encode pool) and for the parts already staged (``upload_and_stage``);
2. assemble the last part: the streams not staged, with the target root digest;
3. upload it and the anchor shards, concurrently, each shard noted on the board once it is up
   (``upload_and_note``);
4. build the ``VersionRecord`` (tensor digests, root, artifacts, ``version_stats``);
5. commit it on the board, retrying transient failures.

Invariants:
- Blobs are content addressed, so a retried upload or commit rewrites the same bytes.
- A patch's parts hold disjoint tensors and together every tensor of the layout; the last
  part (the one carrying the root) is the only one uploaded by this module's step 3.
- Nothing here reads the served view: a job carries what its commit needs.
- An anchor shard is noted (``StagePart`` with its name) as soon as it is uploaded, so the
  board's GC ages an anchor that uploads for longer than its grace by the newest shard, and
  collects the shards of a publisher that died before its commit (``board/gc.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from dataclasses import dataclass
from typing import Any

import structlog
import xxhash

from weftboard.board.blobs.transfer import Uploader, with_retries
from weftboard.cuda import codec
from weftboard.cuda.anchors import WrittenFile
from weftboard.cuda.formats import is_scale_tensor
from weftboard.proto.domain import format_digest
from weftboard.proto.errors import WeftboardError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.job import Job
from weftboard.publisher.parts import staged_names
from weftboard.publisher.served_view import LayoutEntry

log = structlog.get_logger("weftboard.publisher")

# How long a staged part's commit waits for its StagePart call (normally a few milliseconds).
STAGE_WAIT_S = 1.0


@dataclass(frozen=True)
class Committed:
    record: pb.VersionRecord  # as the board stored it
    staged_parts_wanted: bool  # the board's word: some island asks for staged parts
    patch_bytes: int
    anchor_bytes: int
    changed_elements: int


def encode_streams(job: Job, names: list[str], encoding: str) -> list[Any]:
    """The patch's per-tensor streams in layout order: those the read encoded, the rest
    encoded here from the job's deltas (runs on the encode pool)."""
    t_enc = time.perf_counter()
    assert job.deltas is not None
    encoded = dict(job.fused)
    todo = [n for n in names if n not in encoded]
    encoded.update(zip(todo, codec.encode_streams([(n, job.deltas[n]) for n in todo], encoding=encoding), strict=True))
    job.timings["encode_s"] = time.perf_counter() - t_enc
    return [encoded[n] for n in names]


async def upload_and_stage(version: int, data: bytes, *, run: str, client: Any, uploader: Uploader,
                           staging: set[asyncio.Future]) -> pb.BlobRef:
    """Upload one patch part, then tell the board's watchers (``StagePart``).

    The part's ref (which the commit waits for) is ready once the hint went out, or after
    ``STAGE_WAIT_S``: a hint is worth nothing after the commit, and a commit that follows it
    finds the part already checked. A refused or failed StagePart only means islands fetch
    the part after the commit. The StagePart call is held in ``staging`` until it ends.
    """
    digest = format_digest(xxhash.xxh3_128(data).digest())
    key = await uploader.upload(digest, len(data), data=data, skip_existing=False)
    ref = pb.BlobRef(key=key, digest=digest, size=len(data))

    async def stage() -> None:
        try:
            await client.stage_part(run, version, ref)
        except WeftboardError as exc:
            log.info("patch part not staged; islands fetch it after the commit", run=run, version=version,
                     error=str(exc))

    task = asyncio.ensure_future(stage())
    staging.add(task)
    task.add_done_callback(staging.discard)
    await asyncio.wait({task}, timeout=STAGE_WAIT_S)  # not cancelled when slower: the publisher's close does that
    return ref


async def upload_and_note(wf: WrittenFile, version: int, *, run: str, client: Any, uploader: Uploader) -> str:
    """Upload one anchor shard, then note it on the board (``StagePart`` with its file name); its
    key. A note refused or failed is logged: the version commits all the same, only GC's view
    of an upload in progress is the poorer for it."""
    key = await uploader.upload(wf.digest, wf.size, path=wf.path)
    ref = pb.BlobRef(key=key, digest=wf.digest, size=wf.size, name=wf.name)
    try:
        await with_retries("StagePart", lambda: client.stage_part(run, version, ref))
    except WeftboardError as exc:
        log.info("anchor shard not noted", run=run, version=version, file=wf.name, error=str(exc))
    return key


def version_stats(job: Job, layout: list[LayoutEntry], patch_bytes: int, anchor_bytes: int,
                  streams: list[Any] = ()) -> pb.VersionStats:
    """The record's statistics; each changed tensor says which coder carried it (``streams``:
    the patch's ``EncodedTensor`` list, empty without a patch)."""
    coders = {s.name: (s.mode, int(s.stream.size)) for s in streams}
    tensors = []
    changed_total = total = scale_changed = 0
    for name, _dtype, shape in layout:
        numel = math.prod(int(s) for s in shape)
        changed = job.changed[name] if job.has_patch else numel
        total += numel
        changed_total += changed
        if is_scale_tensor(name):
            scale_changed += changed
        if changed:
            coder, stream_bytes = coders.get(name, ("", 0))
            tensors.append(pb.TensorStats(name=name, changed=changed, numel=numel, coder=coder,
                                          stream_bytes=stream_bytes))
    return pb.VersionStats(
        changed_elements=changed_total,
        total_elements=total,
        density=changed_total / total if total else 0.0,
        patch_bytes=patch_bytes,
        anchor_bytes=anchor_bytes,
        tensors=tensors,
        scale_changed_elements=scale_changed,
    )


async def commit_job(job: Job, *, run: str, layout: list[LayoutEntry], client: Any, uploader: Uploader,
                     encode_pool: concurrent.futures.Executor, encoding: str) -> Committed:
    """Steps 1-5 of the module docstring for ``job`` (snapshotted: digests, root and anchor files set)."""
    names = [n for n, _, _ in layout]
    artifacts: list[pb.Artifact] = []
    patch_refs: list[pb.BlobRef] = []
    uploads = []
    patch_bytes = 0
    streams: list[Any] = []
    if job.has_patch:
        # 1. the streams and the staged parts
        t_wait = time.perf_counter()
        if job.streams is None:
            job.streams = encode_pool.submit(encode_streams, job, names, encoding)
        streams = await asyncio.wrap_future(job.streams)
        patch_refs = [await asyncio.wrap_future(f) for _, f in job.parts]
        # 2. the last part: every tensor not staged, and the root
        staged = staged_names(job.parts)
        rest = [s for s in streams if s.name not in staged]
        data = b""
        if rest or not patch_refs:
            data = (await asyncio.to_thread(
                codec.assemble_patch, rest,
                base_version=job.version - 1, target_version=job.version, target_root=job.root, encoding=encoding,
            )).data
        job.timings["encode_wait_s"] = time.perf_counter() - t_wait
        patch_bytes = sum(r.size for r in patch_refs) + len(data)
        if data:
            digest = format_digest(xxhash.xxh3_128(data).digest())
            uploads.append(uploader.upload(digest, len(data), data=data))
            patch_refs.append(pb.BlobRef(digest=digest, size=len(data)))
    # 3. upload the last part and the anchor shards
    uploads += [upload_and_note(wf, job.version, run=run, client=client, uploader=uploader) for wf in job.anchor_files]
    anchor_bytes = sum(wf.size for wf in job.anchor_files)
    t_up = time.perf_counter()
    keys = await asyncio.gather(*uploads)
    job.timings["upload_s"] = time.perf_counter() - t_up
    # 4. the record
    last_part_uploaded = len(keys) - len(job.anchor_files)  # 1 when the last patch part was uploaded here
    if patch_refs:
        if last_part_uploaded:
            patch_refs[-1].key = keys[0]
        artifacts.append(pb.Artifact(kind=pb.ARTIFACT_KIND_PATCH, base_version=job.version - 1, blobs=patch_refs))
    if job.anchor_files:
        shard_keys = keys[last_part_uploaded:]
        artifacts.append(pb.Artifact(kind=pb.ARTIFACT_KIND_ANCHOR, base_version=0, blobs=[
            pb.BlobRef(key=k, digest=wf.digest, size=wf.size, name=wf.name)
            for k, wf in zip(shard_keys, job.anchor_files, strict=True)
        ]))
    record = pb.VersionRecord(
        run=run,
        version=job.version,
        parent=job.version - 1,
        tensor_digests=[pb.TensorDigest(name=n, digest=job.digests[n]) for n in names],
        root_digest=job.root,
        artifacts=artifacts,
        stats=version_stats(job, layout, patch_bytes, anchor_bytes, streams),
        step=job.step,
        labels=job.labels,
        created_at_ms=int(time.time() * 1000),
    )
    # 5. commit
    t_commit = time.perf_counter()
    response = await with_retries(f"commit of version {job.version}", lambda: client.commit_version(record))
    job.timings["commit_s"] = time.perf_counter() - t_commit
    job.timings["committed_s"] = time.perf_counter() - job.t_publish
    log.info("committed", run=run, version=job.version, patch_bytes=patch_bytes, anchor_bytes=anchor_bytes,
             density=round(record.stats.density, 6), anchor=job.anchor, reason=job.reason.value,
             latency_s=round(time.perf_counter() - job.t_publish, 3),
             **{k: round(v, 4) for k, v in job.timings.items()})
    return Committed(response.record, response.staged_parts_wanted, patch_bytes, anchor_bytes,
                     record.stats.changed_elements)
