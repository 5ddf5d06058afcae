"""Helpers for board tests: runs with a small layout, real blobs, and version records.

Blobs are real bytes uploaded to the test's blob store, digested with xxh3-128 like the
publisher does, so the board's existence and size checks run for real.
"""

from __future__ import annotations

import os
import subprocess
import time

import xxhash

from weftboard.proto.domain import blob_key, format_digest
from weftboard.proto.v1 import board_pb2 as pb

LAYOUT = (("w.0", "bfloat16", (4, 8)), ("w.1", "bfloat16", (8,)))


def digest_of(data: bytes) -> str:
    return format_digest(xxhash.xxh3_128_digest(data))


def make_run(name: str, *, keep_anchors: int = 0, keep_versions: int = 0) -> pb.Run:
    return pb.Run(
        run=name,
        kind=pb.RUN_KIND_WEIGHTS,
        served_format=pb.ServedFormat(kind=pb.FORMAT_KIND_BF16),
        layout=pb.Layout(tensors=[pb.TensorSpec(name=n, dtype=d, shape=s) for n, d, s in LAYOUT]),
        retention=pb.RetentionPolicy(keep_anchors=keep_anchors, keep_versions=keep_versions),
    )


async def upload(blobs, run: str, data: bytes, name: str = "") -> pb.BlobRef:
    digest = digest_of(data)
    key = blob_key(run, digest)
    await blobs.put_bytes(key, data)
    return pb.BlobRef(key=key, digest=digest, size=len(data), name=name)


async def make_record(
    blobs, run: str, version: int, *, anchor: bool | None = None, patch: bool | None = None, size: int = 64
) -> pb.VersionRecord:
    """A valid record of ``version`` whose blobs exist; version 1 gets an anchor, later ones a patch."""
    anchor = version == 1 if anchor is None else anchor
    patch = version > 1 if patch is None else patch
    artifacts = []
    if patch:
        ref = await upload(blobs, run, os.urandom(size))
        artifacts.append(pb.Artifact(kind=pb.ARTIFACT_KIND_PATCH, base_version=version - 1, blobs=[ref]))
    if anchor:
        ref = await upload(blobs, run, os.urandom(size * 8), name="model.safetensors")
        artifacts.append(pb.Artifact(kind=pb.ARTIFACT_KIND_ANCHOR, base_version=0, blobs=[ref]))
    return pb.VersionRecord(
        run=run,
        version=version,
        parent=version - 1,
        tensor_digests=[pb.TensorDigest(name=n, digest=digest_of(os.urandom(8))) for n, _, _ in LAYOUT],
        root_digest=digest_of(os.urandom(8)),
        artifacts=artifacts,
        stats=pb.VersionStats(changed_elements=3, total_elements=40, density=3 / 40),
        step=version * 10,
    )


async def publish(client, blobs, run: str, versions, **kw) -> list[pb.VersionRecord]:
    """Commit each version in ``versions`` in order; returns the stored records."""
    out = []
    for v in versions:
        record = await make_record(blobs, run, v, **kw)
        out.append((await client.commit_version(record)).record)
    return out


def read_serve_banner(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    """The banner a ``weftboard serve`` subprocess printed (through its ``data dir`` line); fails
    the test with what it printed if it exits first or prints none within ``timeout_s``."""
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"serve exited early ({proc.wait()}):\n{''.join(lines)}\n{proc.stderr.read()}")
        lines.append(line)
        if line.startswith("data dir"):
            return "".join(lines)
    raise AssertionError(f"no banner within {timeout_s}s:\n{''.join(lines)}")
