"""Every RPC of the board against a real redis-server and real blob stores (SeaweedFS S3, local dir)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import pytest_asyncio
from boardkit import make_record, make_run, publish, upload
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weftboard.board.client import BoardClient
from weftboard.proto import errors
from weftboard.proto.v1 import board_pb2 as pb


@pytest_asyncio.fixture
async def admin(board):
    async with BoardClient(board.address, board.admin_token) as client:
        yield client


async def client_for(board, admin: BoardClient, role: int) -> BoardClient:
    created = await admin.create_token(f"test-{role}", role)
    return BoardClient(board.address, created.token)


@pytest_asyncio.fixture
async def pub(board, admin):
    async with await client_for(board, admin, pb.ROLE_PUBLISHER) as client:
        yield client


@pytest_asyncio.fixture
async def island(board, admin):
    async with await client_for(board, admin, pb.ROLE_ISLAND) as client:
        yield client


@pytest_asyncio.fixture
async def reader(board, admin):
    async with await client_for(board, admin, pb.ROLE_READER) as client:
        yield client


# -- runs ---------------------------------------------------------------------


async def test_create_get_list_runs(pub, reader):
    created = await pub.create_run(make_run("alpha"))
    assert created.run == "alpha" and created.created_at_ms > 0 and created.head == 0
    again = await pub.create_run(make_run("alpha"))  # identical: idempotent
    assert again.created_at_ms == created.created_at_ms
    different = make_run("alpha")
    different.layout.tensors[0].shape[:] = [4, 9]
    with pytest.raises(errors.AlreadyExists, match="different"):
        await pub.create_run(different)
    got = await pub.get_run("alpha")
    assert got.layout == created.layout
    with pytest.raises(errors.NotFound, match="'nope'"):
        await pub.get_run("nope")
    for name in ("c", "b", "d"):
        await pub.create_run(make_run(name))
    page = await reader.list_runs(page_size=2)
    assert [r.run for r in page.runs] == ["alpha", "b"] and page.next_page_token
    page2 = await reader.list_runs(page_size=2, page_token=page.next_page_token)
    assert [r.run for r in page2.runs] == ["c", "d"] and page2.next_page_token == ""
    assert [r.run for r in await reader.all_runs()] == ["alpha", "b", "c", "d"]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: setattr(r, "run", "bad name"), "run.run"),
        (lambda r: setattr(r, "run", "-x"), "run.run"),
        (lambda r: setattr(r, "run", "r1\n"), "run.run"),  # a distinct run whose keys end in a newline, before
        (lambda r: setattr(r, "kind", pb.RUN_KIND_UNSPECIFIED), "run.kind"),
        (lambda r: r.served_format.Clear(), "served_format"),
        (lambda r: setattr(r.served_format, "kind", 99), "served_format.kind unknown.99. is not a value"),
        (lambda r: setattr(r.served_format, "scale_policy", 77), "served_format.scale_policy unknown.77."),
        (lambda r: r.layout.Clear(), "layout"),
        (lambda r: setattr(r.layout.tensors[1], "name", "w.0"), "twice"),
        (lambda r: setattr(r.layout.tensors[0], "dtype", "Bfloat 16"), "dtype"),
        (lambda r: setattr(r.layout.tensors[0], "dtype", "bfloat16\n"), "dtype"),
        (lambda r: r.layout.tensors[0].shape.append(-1), "negative"),
    ],
)
async def test_create_run_malformed(pub, mutate, match):
    run = make_run("r1")
    mutate(run)
    with pytest.raises(errors.InvalidArgument, match=match):
        await pub.create_run(run)


async def test_list_runs_page_size_limits(reader):
    with pytest.raises(errors.InvalidArgument, match="page_size"):
        await reader.list_runs(page_size=1001)
    with pytest.raises(errors.InvalidArgument, match="page_token"):
        await reader.list_runs(page_token="no such/token")


# -- commit -------------------------------------------------------------------


async def test_commit_and_read_back(pub, reader, local_store):
    await pub.create_run(make_run("r"))
    records = await publish(pub, local_store, "r", [1, 2, 3])
    assert all(r.committed_at_ms > 0 for r in records)
    head = await reader.get_head("r")
    assert (head.version, head.oldest_available) == (3, 1)
    assert head.committed_at_ms == records[-1].committed_at_ms
    v2 = await reader.get_version("r", 2)
    assert v2 == records[1]
    with pytest.raises(errors.NotFound, match="head is 3"):
        await reader.get_version("r", 4)
    with pytest.raises(errors.InvalidArgument):
        await reader.get_version("r", 0)
    run = await reader.get_run("r")
    assert run.head == 3


async def test_commit_retry_identical_and_different(pub, local_store):
    await pub.create_run(make_run("r"))
    record = await make_record(local_store, "r", 1)
    first = await pub.commit_version(record)
    assert not first.already_committed
    retry = await pub.commit_version(record)
    assert retry.already_committed and retry.record == first.record
    await publish(pub, local_store, "r", [2])
    assert (await pub.commit_version(record)).already_committed  # an older version, retried
    other = await make_record(local_store, "r", 1)
    with pytest.raises(errors.AlreadyExists, match="version 1"):
        await pub.commit_version(other)
    other2 = await make_record(local_store, "r", 2)  # a different record for the head: a lost race
    with pytest.raises(errors.Aborted, match="lost a race"):
        await pub.commit_version(other2)


async def test_two_publishers_race_exactly_one_wins(board, admin, local_store):
    async with await client_for(board, admin, pb.ROLE_PUBLISHER) as a, await client_for(
        board, admin, pb.ROLE_PUBLISHER
    ) as b:
        await a.create_run(make_run("race"))
        await publish(a, local_store, "race", [1])
        for n in range(2, 8):
            ra = await make_record(local_store, "race", n)
            rb = await make_record(local_store, "race", n)
            results = await asyncio.gather(a.commit_version(ra), b.commit_version(rb), return_exceptions=True)
            wins = [r for r in results if isinstance(r, pb.CommitVersionResponse)]
            losses = [r for r in results if isinstance(r, BaseException)]
            assert len(wins) == 1 and len(losses) == 1, results
            assert isinstance(losses[0], errors.Aborted), losses[0]
            assert f"head is now {n}" in str(losses[0])
            winner = wins[0].record
            assert (await a.get_version("race", n)) == winner
        assert (await a.get_head("race")).version == 7


async def test_race_loser_gets_aborted_when_head_moved(pub, local_store):
    await pub.create_run(make_run("r"))
    await publish(pub, local_store, "r", [1, 2])
    stale = await make_record(local_store, "r", 2)  # a publisher that thinks head is 1
    with pytest.raises(errors.Aborted, match="head is now 2"):
        await pub.commit_version(stale)
    skip = await make_record(local_store, "r", 4)
    with pytest.raises(errors.Aborted, match="head is 2"):
        await pub.commit_version(skip)


async def test_commit_missing_or_wrong_size_blob(pub, local_store):
    await pub.create_run(make_run("r"))
    record = await make_record(local_store, "r", 1)
    key = record.artifacts[0].blobs[0].key
    wrong = pb.VersionRecord()
    wrong.CopyFrom(record)
    wrong.artifacts[0].blobs[0].size += 1
    with pytest.raises(errors.FailedPrecondition, match="bytes but the record declares"):
        await pub.commit_version(wrong)
    await local_store.delete([key])
    with pytest.raises(errors.FailedPrecondition, match=key):
        await pub.commit_version(record)
    assert (await pub.get_head("r")).version == 0


async def test_commit_against_s3(board_factory, s3_store):
    running = await board_factory(blobs=s3_store)
    async with BoardClient(running.address, running.admin_token) as client:
        await client.create_run(make_run("s3run"))
        records = await publish(client, s3_store, "s3run", [1, 2])
        assert records[1].version == 2
        missing = await make_record(s3_store, "s3run", 3)
        await s3_store.delete([missing.artifacts[0].blobs[0].key])
        with pytest.raises(errors.FailedPrecondition, match="does not exist"):
            await client.commit_version(missing)
        plan = await client.plan_catch_up("s3run", 0, 0, presign=True)
        assert [s.to_version for s in plan.steps] == [1, 2]
        assert all(b.url.startswith("http") for s in plan.steps for b in s.blobs)


async def test_a_blob_store_refusing_the_boards_own_credentials_is_unavailable(board_factory, s3_server, s3_store):
    """Whose credentials were refused decides the code: the board's own (its operator's to fix)
    are UNAVAILABLE to a publisher committing, not PERMISSION_DENIED, which names the caller's token."""
    from weftboard.board.blobs import S3BlobStore

    wrong = S3BlobStore(s3_server.endpoint, "nobody", "not-the-secret", s3_server.bucket, region="us-east-1",
                        prefix=s3_store.prefix)
    try:
        running = await board_factory(blobs=wrong)
        async with BoardClient(running.address, running.admin_token) as client:
            await client.create_run(make_run("creds"))
            record = await make_record(s3_store, "creds", 1, anchor=True)  # the blobs are there
            with pytest.raises(errors.Unavailable, match="refused the board's own credentials"):
                await client.commit_version(record)
    finally:
        await wrong.close()


def _mutations():
    def bad_root(r):
        r.root_digest = "sha256:abc"

    def bad_tensor_digest(r):
        r.tensor_digests[0].digest = "xxh3-128:XYZ"

    def parent(r):
        r.parent = 0

    def no_artifacts(r):
        del r.artifacts[:]

    def patch_base(r):
        r.artifacts[0].base_version = 0

    def same_part_twice(r):
        r.artifacts[0].blobs.append(r.artifacts[0].blobs[0])

    def no_patch_blobs(r):
        r.artifacts[0].ClearField("blobs")

    def wrong_key(r):
        r.artifacts[0].blobs[0].key = "r/blobs/other"

    def kind_unspecified(r):
        r.artifacts[0].kind = pb.ARTIFACT_KIND_UNSPECIFIED

    def bad_run(r):
        r.run = "no/such"

    def version_zero(r):
        r.version = 0

    return [
        (bad_root, errors.InvalidArgument, "root_digest"),
        (bad_tensor_digest, errors.InvalidArgument, "tensor_digests"),
        (parent, errors.InvalidArgument, "parent"),
        (no_artifacts, errors.InvalidArgument, "artifacts"),
        (patch_base, errors.InvalidArgument, "base_version"),
        (same_part_twice, errors.InvalidArgument, "same part twice"),
        (no_patch_blobs, errors.InvalidArgument, "at least one part"),
        (wrong_key, errors.InvalidArgument, "content-addressed"),
        (kind_unspecified, errors.InvalidArgument, "kind"),
        (bad_run, errors.InvalidArgument, "record.run"),
        (version_zero, errors.InvalidArgument, "version"),
    ]


@pytest.mark.parametrize("mutate, exc, match", _mutations())
async def test_commit_malformed_records(pub, local_store, mutate, exc, match):
    await pub.create_run(make_run("r"))
    await publish(pub, local_store, "r", [1])
    record = await make_record(local_store, "r", 2)
    mutate(record)
    with pytest.raises(exc, match=match):
        await pub.commit_version(record)


async def test_commit_layout_mismatch_and_first_version_without_anchor(pub, local_store):
    await pub.create_run(make_run("r"))
    no_anchor = await make_record(local_store, "r", 1, anchor=False, patch=False)
    no_anchor.artifacts.append(pb.Artifact(kind=pb.ARTIFACT_KIND_PATCH, base_version=0,
                                           blobs=[await upload(local_store, "r", b"x")]))
    with pytest.raises(errors.InvalidArgument, match="version 1"):
        await pub.commit_version(no_anchor)
    record = await make_record(local_store, "r", 1)
    record.tensor_digests[0].name = "w.other"
    with pytest.raises(errors.FailedPrecondition, match="layout"):
        await pub.commit_version(record)
    record = await make_record(local_store, "r", 1)
    record.tensor_digests.reverse()
    with pytest.raises(errors.FailedPrecondition, match="out of order"):
        await pub.commit_version(record)
    record = await make_record(local_store, "r", 1)
    record.stats.tensors.append(pb.TensorStats(name="w.0", changed=1, numel=31))
    with pytest.raises(errors.FailedPrecondition, match="numel"):
        await pub.commit_version(record)
    with pytest.raises(errors.NotFound, match="does not exist"):
        await pub.commit_version(await make_record(local_store, "ghost", 1))


async def test_presign_upload(board_factory, s3_store, local_store):
    import aiohttp

    running = await board_factory(blobs=s3_store)
    async with BoardClient(running.address, running.admin_token) as client:
        await client.create_run(make_run("p"))
        data = b"presigned bytes" * 10
        from boardkit import digest_of

        resp = await client.presign_upload("p", digest_of(data), len(data), expires_s=60)
        assert resp.key == f"p/blobs/{digest_of(data).split(':')[1]}"
        async with aiohttp.ClientSession() as session:
            async with session.put(resp.url, data=data) as r:
                assert r.status == 200
        assert await s3_store.stat(resp.key) == len(data)
        with pytest.raises(errors.InvalidArgument, match="expires_s"):
            await client.presign_upload("p", digest_of(data), len(data), expires_s=3601)
        with pytest.raises(errors.InvalidArgument, match="digest"):
            await client.presign_upload("p", "xxh3-128:zz", 1)
    local = await board_factory(blobs=local_store)
    async with BoardClient(local.address, local.admin_token) as client:
        await client.create_run(make_run("p2"))
        with pytest.raises(errors.FailedPrecondition, match="cannot presign"):
            await client.presign_upload("p2", digest_of(b"x"), 1)


# -- history ------------------------------------------------------------------


async def test_list_versions_pages_and_ranges(pub, reader, local_store):
    await pub.create_run(make_run("r"))
    await publish(pub, local_store, "r", range(1, 8))
    page = await reader.list_versions("r", page_size=3)
    assert [v.version for v in page.versions] == [1, 2, 3] and page.next_page_token
    rest = [v.version async for v in reader.iter_versions("r", from_version=2, to_version=6)]
    assert rest == [2, 3, 4, 5, 6]
    seen = []
    token = ""
    while True:
        p = await reader.list_versions("r", 3, 0, page_size=2, page_token=token)
        seen += [v.version for v in p.versions]
        token = p.next_page_token
        if not token:
            break
    assert seen == [3, 4, 5, 6, 7]
    with pytest.raises(errors.InvalidArgument, match="page_size"):
        await reader.list_versions("r", page_size=5000)
    with pytest.raises(errors.InvalidArgument, match="after to_version"):
        await reader.list_versions("r", 5, 2)
    with pytest.raises(errors.InvalidArgument, match="page_token"):
        await reader.list_versions("r", page_token="abc")
    with pytest.raises(errors.NotFound):
        await reader.list_versions("missing")


async def test_a_page_of_large_records_ends_before_its_byte_budget(pub, reader, local_store, monkeypatch):
    """Records of a model with many tensors are large: a page ends once the next record would
    pass ``MAX_PAGE_BYTES`` (at least one record a page), and the pages still list every
    version once, in order."""
    from weftboard.board import handlers

    await pub.create_run(make_run("big"))
    records = await publish(pub, local_store, "big", range(1, 11))
    one = max(r.ByteSize() for r in records)
    monkeypatch.setattr(handlers, "MAX_PAGE_BYTES", 3 * one)  # the board runs in this process
    page = await reader.list_versions("big", page_size=1000)
    assert 1 <= len(page.versions) <= 3 and page.next_page_token == str(len(page.versions) + 1)
    assert [v.version async for v in reader.iter_versions("big")] == list(range(1, 11))
    monkeypatch.setattr(handlers, "MAX_PAGE_BYTES", 1)  # smaller than any record: one a page
    page = await reader.list_versions("big", page_size=1000)
    assert [v.version for v in page.versions] == [1] and page.next_page_token == "2"


# -- catch-up -----------------------------------------------------------------


async def test_plan_catch_up(pub, island, local_store):
    await pub.create_run(make_run("r"))
    with pytest.raises(errors.FailedPrecondition, match="no committed version"):
        await island.plan_catch_up("r")
    await publish(pub, local_store, "r", [1, 2, 3, 4])
    await publish(pub, local_store, "r", [5], anchor=True)  # patch and anchor
    plan = await island.plan_catch_up("r", have_version=2)
    assert [(s.kind, s.from_version, s.to_version) for s in plan.steps] == [
        (pb.ARTIFACT_KIND_PATCH, 2, 3), (pb.ARTIFACT_KIND_PATCH, 3, 4), (pb.ARTIFACT_KIND_PATCH, 4, 5)
    ]
    assert plan.total_bytes == sum(b.size for s in plan.steps for b in s.blobs)
    v5 = await island.get_version("r", 5)
    assert plan.steps[-1].root_digest == v5.root_digest
    fresh = await island.plan_catch_up("r", have_version=0)
    assert [(s.kind, s.to_version) for s in fresh.steps] == [(pb.ARTIFACT_KIND_ANCHOR, 5)]
    assert fresh.steps[0].blobs[0].name == "model.safetensors"
    assert fresh.steps[0].blobs[0].url == ""  # local dir store cannot presign
    to3 = await island.plan_catch_up("r", have_version=0, want_version=3)
    assert [s.to_version for s in to3.steps] == [1, 2, 3]
    same = await island.plan_catch_up("r", have_version=5)
    assert list(same.steps) == [] and same.to_version == 5
    with pytest.raises(errors.OutOfRange, match="beyond the head"):
        await island.plan_catch_up("r", want_version=9)
    with pytest.raises(errors.InvalidArgument, match="presign_expires_s"):
        await island.plan_catch_up("r", presign=True, presign_expires_s=99999)
    with pytest.raises(errors.NotFound):
        await island.plan_catch_up("nothing")


# -- fleet --------------------------------------------------------------------


async def test_heartbeat_and_list_islands_with_expiry(pub, island, reader, local_store):
    await pub.create_run(make_run("r"))
    await publish(pub, local_store, "r", [1, 2, 3])
    long = pb.IslandStatus(island_id="isl-a", run="r", region="eu", version=3, state=pb.ISLAND_STATE_READY, capacity=4)
    short = pb.IslandStatus(island_id="isl-b", run="r", region="us", version=1, state=pb.ISLAND_STATE_CATCHING_UP)
    resp = await island.heartbeat(long, lease_s=60)
    assert resp.head == 3 and resp.lease_expires_at_ms > 0
    await island.heartbeat(short, lease_s=1)
    listing = await reader.list_islands("r")
    assert listing.head == 3
    by_id = {i.status.island_id: i for i in listing.islands}
    assert by_id["isl-a"].lag == 0 and by_id["isl-b"].lag == 2
    assert by_id["isl-b"].status.state == pb.ISLAND_STATE_CATCHING_UP
    await asyncio.sleep(1.2)
    by_id = {i.status.island_id: i for i in (await reader.list_islands("r")).islands}
    assert by_id["isl-b"].status.state == pb.ISLAND_STATE_EXPIRED
    assert by_id["isl-a"].status.state == pb.ISLAND_STATE_READY
    assert by_id["isl-a"].status.region == "eu" and by_id["isl-a"].status.capacity == 4
    await island.heartbeat(short, lease_s=30)  # renewing revives it
    by_id = {i.status.island_id: i for i in (await reader.list_islands("r")).islands}
    assert by_id["isl-b"].status.state == pb.ISLAND_STATE_CATCHING_UP


@pytest.mark.parametrize(
    "status, lease, match",
    [
        (pb.IslandStatus(island_id="bad id", run="r", state=pb.ISLAND_STATE_READY), 0, "island_id"),
        (pb.IslandStatus(island_id="i", run="r", state=pb.ISLAND_STATE_EXPIRED), 0, "EXPIRED"),
        (pb.IslandStatus(island_id="i", run="r"), 0, "state"),
        (pb.IslandStatus(island_id="i", run="r", state=pb.ISLAND_STATE_READY), 601, "lease_s"),
    ],
)
async def test_heartbeat_malformed(pub, island, status, lease, match):
    await pub.create_run(make_run("r"))
    with pytest.raises(errors.InvalidArgument, match=match):
        await island.heartbeat(status, lease_s=lease)


# -- admin --------------------------------------------------------------------


async def test_tokens_create_and_revoke(board, admin):
    created = await admin.create_token("ci", pb.ROLE_READER)
    async with BoardClient(board.address, created.token) as reader:
        await reader.list_runs()
        await admin.revoke_token(created.token_id)
        with pytest.raises(errors.Unauthenticated, match="unknown or revoked"):
            await reader.list_runs()
    with pytest.raises(errors.NotFound, match="token id"):
        await admin.revoke_token(created.token_id)
    with pytest.raises(errors.InvalidArgument, match="role"):
        await admin.create_token("x", pb.ROLE_UNSPECIFIED)
    with pytest.raises(errors.InvalidArgument, match="name"):
        await admin.create_token("", pb.ROLE_READER)


async def test_redis_outage_is_unavailable(tmp_path, local_store):
    """A board whose Redis goes away answers UNAVAILABLE (safe to retry), not INTERNAL."""
    from weftboard.board.embedded import start_redis
    from weftboard.board.process import BoardConfig, start_board

    proc = start_redis(tmp_path / "own-redis")
    running = None
    try:
        config = BoardConfig(redis_url=f"redis://127.0.0.1:{proc.port}/0", admin_token="a" * 32, health_check_s=0.2)
        running = await start_board(config, blobs=local_store)
        async with BoardClient(running.address, "a" * 32) as client:
            await client.create_run(make_run("r"))
            proc.stop()
            with pytest.raises(errors.Unavailable, match="Redis"):
                await client.get_head("r")
            health = health_pb2_grpc.HealthStub(client.channel)
            for _ in range(50):
                resp = await health.Check(health_pb2.HealthCheckRequest(service="weftboard.v1.Board"), timeout=5)
                if resp.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.1)
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        if running is not None:
            await running.stop()
        proc.stop()


@contextlib.asynccontextmanager
async def _board_on_own_redis(tmp_path, local_store):
    """A board on a Redis of its own (for tests that reconfigure it): its admin client and a
    plain client of that Redis."""
    import redis.asyncio as aioredis

    from weftboard.board.embedded import start_redis
    from weftboard.board.process import BoardConfig, start_board

    proc = start_redis(tmp_path / "own-redis")
    running = None
    admin_redis = aioredis.from_url(f"redis://127.0.0.1:{proc.port}/0")
    try:
        config = BoardConfig(redis_url=f"redis://127.0.0.1:{proc.port}/0", admin_token="a" * 32)
        running = await start_board(config, blobs=local_store)
        async with BoardClient(running.address, "a" * 32) as client:
            await client.create_run(make_run("r"))
            yield client, admin_redis
    finally:
        await admin_redis.aclose()
        if running is not None:
            await running.stop()
        proc.stop()


async def test_a_redis_that_became_a_replica_is_unavailable(tmp_path, local_store):
    """A failover leaves the board's Redis URL on a replica for a while: its writes are refused
    (READONLY), which a caller should retry (UNAVAILABLE), not take for a bug (INTERNAL)."""
    async with _board_on_own_redis(tmp_path, local_store) as (client, admin_redis):
        await admin_redis.execute_command("REPLICAOF", "127.0.0.1", "1")  # a master that is not there
        with pytest.raises(errors.Unavailable, match="refuses writes, being a replica"):
            await client.create_run(make_run("r2"))
        assert (await client.get_head("r")).version == 0  # reads still answer
        await admin_redis.execute_command("REPLICAOF", "NO", "ONE")
        assert (await client.create_run(make_run("r2"))).run == "r2"


async def test_a_redis_out_of_memory_is_unavailable(tmp_path, local_store):
    """A Redis at its memory limit refuses writes (OOM) until memory is freed: a caller should
    retry (UNAVAILABLE), not take it for a bug of the board (INTERNAL)."""
    async with _board_on_own_redis(tmp_path, local_store) as (client, admin_redis):
        await admin_redis.config_set("maxmemory", "1")  # every write is over the limit now
        with pytest.raises(errors.Unavailable, match="refused the command for now .*maxmemory"):
            await client.create_run(make_run("r2"))
        assert (await client.get_head("r")).version == 0  # reads still answer
        await admin_redis.config_set("maxmemory", "0")
        assert (await client.create_run(make_run("r2"))).run == "r2"


async def test_logs_bind_run_version_peer_and_method(board, local_store):
    import structlog
    from structlog.testing import LogCapture

    capture = LogCapture()
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture], cache_logger_on_first_use=False)
    try:
        async with BoardClient(board.address, board.admin_token) as client:
            await client.create_run(make_run("logged"))
            await publish(client, local_store, "logged", [1])
            with pytest.raises(errors.NotFound):
                await client.get_version("logged", 9)
    finally:
        structlog.reset_defaults()
    committed = [e for e in capture.entries if e["event"] == "version committed"]
    assert len(committed) == 1
    assert committed[0]["run"] == "logged" and committed[0]["version"] == 1
    assert committed[0]["method"] == "CommitVersion" and committed[0]["peer"].startswith("ipv4:127.0.0.1:")
    refused = [e for e in capture.entries if e["event"] == "rpc refused"]
    assert refused and refused[-1]["code"] == "NOT_FOUND" and refused[-1]["version"] == 9
    created = [e for e in capture.entries if e["event"] == "run created"]
    assert created[0]["run"] == "logged"


@pytest.mark.parametrize(
    "method, request_",
    [
        ("GetRun", pb.GetRunRequest(run="bad run")),
        ("GetVersion", pb.GetVersionRequest(run="", version=1)),
        ("GetHead", pb.GetHeadRequest(run="x" * 65)),
        ("ListVersions", pb.ListVersionsRequest(run="a/b")),
        ("PlanCatchUp", pb.PlanCatchUpRequest(run=".hidden")),
        ("ListIslands", pb.ListIslandsRequest(run="sp ace")),
        ("PresignUpload", pb.PresignUploadRequest(run="bad run", digest="xxh3-128:" + "0" * 32)),
        ("CollectGarbage", pb.CollectGarbageRequest(run="bad run")),
        ("ConsumeTrajectories", pb.ConsumeTrajectoriesRequest(run="bad run", group="g", consumer="c")),
        ("AckTrajectories", pb.AckTrajectoriesRequest(run="bad run", group="g")),
        ("ReportTrajectories", pb.ReportTrajectoriesRequest(records=[pb.TrajectoryRecord(run="bad run", island_id="i")])),
    ],
)
async def test_bad_run_names_are_invalid_argument(board, method, request_):
    import grpc

    from weftboard.proto.v1 import board_pb2_grpc

    async with grpc.aio.insecure_channel(board.address) as channel:
        stub = board_pb2_grpc.BoardStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await getattr(stub, method)(request_, metadata=(("authorization", f"Bearer {board.admin_token}"),), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "run" in info.value.details() and "not a valid name" in info.value.details()


async def test_a_response_grpc_could_not_deliver_is_an_info_line_not_an_error_traceback(board, caplog):
    """grpc's asyncio server logs an ERROR with a traceback when a handler's response finds its
    call already ended (the client cancelled or went away: the demo printed one as its islands
    stopped). A running board turns exactly that record into one info line naming the method,
    and lets every other record of grpc's logger through."""
    import logging

    import structlog

    from weftboard.board.logs import GRPC_CORE_LOGGER

    grpc_log = logging.getLogger(GRPC_CORE_LOGGER)
    caplog.set_level(logging.INFO)
    with structlog.testing.capture_logs() as logs:
        try:  # what grpc's _handle_exceptions does with a failed send
            raise RuntimeError('Failed "execute_batch": (SendInitialMetadataOperation, SendMessageOperation)')
        except RuntimeError:
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [%s]",
                               "/weftboard.v1.Board/Heartbeat")
        grpc_log.error("Unexpected [ValueError] raised by servicer method [/weftboard.v1.Board/Commit]")
    assert [r.getMessage() for r in caplog.records if r.name == GRPC_CORE_LOGGER] == [
        "Unexpected [ValueError] raised by servicer method [/weftboard.v1.Board/Commit]"]
    undelivered = [e for e in logs if e["event"].startswith("rpc response not delivered")]
    assert undelivered == [{"event": undelivered[0]["event"], "log_level": "info",
                            "method": "/weftboard.v1.Board/Heartbeat", "error": "RuntimeError"}]
