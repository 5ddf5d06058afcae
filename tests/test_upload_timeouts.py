"""The limits of an upload's PUTs (``Uploader``): each attempt's limit grows with the bytes it
sends (``timeout_s`` plus the bytes at ``min_bytes_per_s``), and the retry deadline outlasts one
attempt, so a blob on a slow link goes up and an attempt that ran out its limit is tried again
rather than failing the publisher. The limits are scaled down through the Uploader's parameters.
A publisher on a slow link sets the rate (``upload_min_bytes_per_s``), checked when it is made.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from boardkit import digest_of

from weftboard.board.blobs import LocalDirBlobStore, transfer
from weftboard.board.blobs.multipart import MIN_PART_BYTES
from weftboard.board.blobs.transfer import Uploader, uploader_options
from weftboard.proto.errors import InvalidArgument, Unavailable
from weftboard.proto.names import blob_key
from weftboard.publisher.publisher import Publisher
from weftboard.publisher.sharded import ShardedPublisher

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

    async def put_part(url: str, *, path: Any, data: Any, offset: int, length: int, timeout_s: float,
                       session: Any) -> str:
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


# -- the publishers' upload_min_bytes_per_s ----------------------------------------------------

SLOW = 1 << 20  # 1 MiB/s: what a trainer on a 10 Mbit/s link passes


def test_uploader_options_carry_the_rate_floor_or_the_default() -> None:
    assert uploader_options() == {"part_bytes": transfer.DEFAULT_PART_BYTES,
                                  "min_bytes_per_s": transfer.DEFAULT_MIN_BYTES_PER_S}
    options = uploader_options(part_bytes=MIN_PART_BYTES, min_bytes_per_s=SLOW)
    assert options == {"part_bytes": MIN_PART_BYTES, "min_bytes_per_s": SLOW}
    assert Uploader("r", client=None, store=object(), **options).attempt_timeout_s(5 * GIB) == 600.0 + 5 * 1024


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "fast", True])
@pytest.mark.parametrize("cls", [Publisher, ShardedPublisher])
def test_a_bad_upload_rate_floor_is_refused_when_the_publisher_is_made(tmp_path: Path, cls: type, bad: Any) -> None:
    """Named as the publisher's option, before the publisher starts threads or makes its work
    dir (a sharded one needs no process group: the option is checked first)."""
    threads = {t.ident for t in threading.enumerate()}
    work_dir = tmp_path / "work"
    with pytest.raises(InvalidArgument, match=r"^upload_min_bytes_per_s must be > 0 .*got"):
        cls("127.0.0.1:1", "r", work_dir=work_dir, upload_min_bytes_per_s=bad)
    assert {t.ident for t in threading.enumerate()} <= threads
    assert not work_dir.exists()
    with pytest.raises(InvalidArgument, match="^min_bytes_per_s must be > 0"):  # the uploader's own check
        Uploader("r", client=None, store=object(), min_bytes_per_s=bad)


def test_the_callback_forwards_the_upload_rate_floor() -> None:
    pytest.importorskip("transformers")
    from weftboard.publisher.hf_callback import WeftboardCallback  # noqa: PLC0415

    callback = WeftboardCallback("127.0.0.1:1", "r", upload_min_bytes_per_s=SLOW)
    assert callback.options == {"upload_min_bytes_per_s": SLOW}


@pytest.mark.parametrize("floor", [SLOW, None])
@pytest.mark.usefixtures("warm_kernels")  # pubsubkit.WARM_KERNELS, for this test only: it publishes
@pytest.mark.timeout(600)
async def test_a_publishers_upload_rate_floor_sets_its_uploads_limits(board, local_store, tmp_path: Path,
                                                                     floor: float | None) -> None:
    state = {"w": torch.randn(16, 8), "b": torch.randn(8)}
    rate = floor or transfer.DEFAULT_MIN_BYTES_PER_S
    shard = 5 * GIB

    def plain() -> Uploader:
        with Publisher(board.address, "plain", token=board.admin_token, blob_store=local_store,
                       work_dir=tmp_path / "plain", upload_min_bytes_per_s=floor) as pub:
            pub.publish(state, step=0).result()
            return pub._uploader

    def sharded() -> Uploader:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
        try:
            with ShardedPublisher(board.address, "sharded", token=board.admin_token, blob_store=local_store,
                                  work_dir=tmp_path / "sharded", upload_min_bytes_per_s=floor) as pub:
                pub.publish(state, step=0).result()
                return pub._uploader
        finally:
            dist.destroy_process_group()

    for publish in (plain, sharded):
        uploader = await asyncio.to_thread(publish)  # it uploaded the version's anchor through this uploader
        assert uploader.min_bytes_per_s == rate
        assert uploader.attempt_timeout_s(shard) == 600.0 + shard / rate  # 600 s + 5120 s at 1 MiB/s
