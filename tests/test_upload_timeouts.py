"""The limits of an upload's PUTs (``Uploader``): each attempt's limit grows with the bytes it
sends (``timeout_s`` plus the bytes at ``min_bytes_per_s``), and the retry deadline outlasts one
attempt, so a blob on a slow link goes up and an attempt that ran out its limit is tried again
rather than failing the publisher. The limits are scaled down through the Uploader's parameters.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from boardkit import digest_of

from weftboard.board.blobs import LocalDirBlobStore, transfer
from weftboard.board.blobs.multipart import MIN_PART_BYTES
from weftboard.board.blobs.transfer import Uploader
from weftboard.proto.errors import InvalidArgument, Unavailable
from weftboard.proto.names import blob_key

GIB = 1 << 30


class SlowLink(LocalDirBlobStore):
    """A store behind a link of ``bytes_per_s``; the first ``hang`` puts never finish."""

    def __init__(self, root: Path, bytes_per_s: float, hang: int = 0) -> None:
        super().__init__(root)
        self.bytes_per_s, self.hang, self.puts = bytes_per_s, hang, 0

    async def _send(self, size: int) -> None:
        self.puts += 1
        if self.puts <= self.hang:
            await asyncio.Event().wait()  # a stalled connection: only the uploader's limit ends it
        await asyncio.sleep(size / self.bytes_per_s)

    async def put_file(self, key: str, path: Path | str) -> int:
        await self._send(Path(path).stat().st_size)
        return await super().put_file(key, path)

    async def put_bytes(self, key: str, data: bytes) -> int:
        await self._send(len(data))
        return await super().put_bytes(key, data)


def test_the_limit_of_an_attempt_grows_with_its_bytes_and_retries_outlast_it() -> None:
    up = Uploader("r", client=None, store=object())
    rate = transfer.DEFAULT_MIN_BYTES_PER_S
    shard = 5 * GIB  # the default anchor shard
    limit = up.attempt_timeout_s(shard)
    assert limit == 600.0 + shard / rate
    assert shard / limit < 72e6 / 8 / 4  # a link a quarter as fast as the old fixed 600 s allowed still fits
    assert up.attempt_timeout_s(100) == pytest.approx(600.0, abs=1e-3)  # small blobs keep the floor
    assert up._retry_deadline_s(limit) > limit  # a timed-out attempt is tried again
    assert up.attempt_timeout_s(GIB, sharing=4) == 600.0 + 4 * GIB / rate
    slow = Uploader("r", client=None, store=object(), min_bytes_per_s=1 << 20)  # what a 10 Mbit/s trainer passes
    assert slow.attempt_timeout_s(shard) == 600.0 + 5 * 1024
    for bad in ({"min_bytes_per_s": 0}, {"timeout_s": 0}, {"retry_deadline_s": 0}):
        with pytest.raises(InvalidArgument):
            Uploader("r", client=None, store=object(), **bad)


@pytest.mark.parametrize("as_file", [True, False])
async def test_a_blob_slower_than_the_floor_but_within_its_rate_goes_up(tmp_path: Path, as_file: bool) -> None:
    data = b"w" * (1 << 20)
    store = SlowLink(tmp_path / "blobs", bytes_per_s=2 << 20)  # 0.5 s for the blob: over the 0.2 s floor
    up = Uploader("r", client=None, store=store, timeout_s=0.2, min_bytes_per_s=1 << 20, retry_deadline_s=0.5)
    assert up.attempt_timeout_s(len(data)) == pytest.approx(1.2)
    src = tmp_path / "shard"
    src.write_bytes(data)
    kw: dict[str, Any] = {"path": src} if as_file else {"data": data}
    key = await up.upload(digest_of(data), len(data), **kw)
    assert key == blob_key("r", digest_of(data))
    assert await store.get_bytes(key) == data
    assert store.puts == 1  # in one attempt: never cut off and sent again


async def test_an_attempt_that_ran_out_its_limit_is_tried_again(tmp_path: Path) -> None:
    data = b"x" * 4096
    store = SlowLink(tmp_path / "blobs", bytes_per_s=1 << 30, hang=1)
    # Old code: a 120 s retry deadline under a fixed 600 s attempt limit; here the attempt's limit
    # (1 s) is twice the retry time beyond it (0.5 s), and the stalled attempt is still retried.
    up = Uploader("r", client=None, store=store, timeout_s=1.0, retry_deadline_s=0.5)
    t0 = time.monotonic()
    key = await up.upload(digest_of(data), len(data), data=data)
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert store.puts == 2
    assert await store.get_bytes(key) == data


async def test_a_put_that_never_finishes_fails_within_its_limits(tmp_path: Path) -> None:
    data = b"y" * 4096
    store = SlowLink(tmp_path / "blobs", bytes_per_s=1 << 30, hang=1000)
    up = Uploader("r", client=None, store=store, timeout_s=0.3, retry_deadline_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="min_bytes_per_s"):
        await up.upload(digest_of(data), len(data), data=data)
    elapsed = time.monotonic() - t0
    assert store.puts >= 2  # retried once at least
    assert elapsed < up._retry_deadline_s(up.attempt_timeout_s(len(data))) + up.attempt_timeout_s(len(data)) + 1.0
    assert await store.stat(blob_key("r", digest_of(data))) is None


async def test_presigned_parts_get_limits_for_their_share_of_the_link() -> None:
    size = 3 * MIN_PART_BYTES
    data = b"z" * size
    limits: dict[int, list[float]] = {}
    completed: list[Any] = []

    class Client:
        timeout_s = 1.0

        async def start_upload(self, run: str, digest: str, size: int, part_bytes: int) -> Any:
            return SimpleNamespace(upload_id="u", parts=[SimpleNamespace(part_number=n, url=f"http://x/{n}")
                                                         for n in (1, 2, 3)])

        async def complete_upload(self, run: str, upload_id: str, etags: Any, *, timeout_s: float) -> None:
            completed.append(etags)

        async def abort_upload(self, run: str, upload_id: str) -> None:
            raise AssertionError("an upload that completes is not aborted")

    async def put_part(url: str, *, path: Any, data: Any, offset: int, length: int, timeout_s: float) -> str:
        number = int(url.rsplit("/", 1)[1])
        limits.setdefault(number, []).append(timeout_s)
        if number == 2 and len(limits[number]) == 1:
            raise asyncio.TimeoutError()  # its first PUT ran out its limit
        return f"etag{number}"

    up = Uploader("r", Client(), part_bytes=MIN_PART_BYTES, parallel_parts=2, put_part=put_part,
                  timeout_s=0.5, min_bytes_per_s=MIN_PART_BYTES, retry_deadline_s=0.5)
    await up.upload(digest_of(data), size, data=data)
    # Two parts at once share the link: each gets twice the time its own bytes need.
    assert limits == {1: [2.5], 2: [2.5, 2.5], 3: [2.5]}
    assert completed == [[(1, "etag1"), (2, "etag2"), (3, "etag3")]]
