"""Auth (every method x every role), health, reflection, metrics and TLS against a real board."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import urllib.request
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from boardkit import make_run, publish
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from weftboard.board.auth import METHOD_ROLES, allowed, bearer
from weftboard.board.client import BoardClient, TlsConfig
from weftboard.proto import errors
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.proto.v1 import board_pb2_grpc as pb_grpc

ROLES = {"PUBLISHER": pb.ROLE_PUBLISHER, "ISLAND": pb.ROLE_ISLAND, "READER": pb.ROLE_READER, "ADMIN": pb.ROLE_ADMIN}

# One well-formed request per method, so that an allowed role never fails on auth.
REQUESTS = {
    "CreateRun": pb.CreateRunRequest(run=make_run("authrun")),
    "GetRun": pb.GetRunRequest(run="authrun"),
    "ListRuns": pb.ListRunsRequest(),
    "GetModelFiles": pb.GetModelFilesRequest(run="authrun"),
    "PresignUpload": pb.PresignUploadRequest(run="authrun", digest="xxh3-128:" + "0" * 32, size=1),
    "StartUpload": pb.StartUploadRequest(run="authrun", digest="xxh3-128:" + "0" * 32, size=6 << 20,
                                         part_bytes=5 << 20),
    "PresignUploadParts": pb.PresignUploadPartsRequest(run="authrun", upload_id="nope", part_numbers=[1]),
    "CompleteUpload": pb.CompleteUploadRequest(run="authrun", upload_id="nope"),
    "AbortUpload": pb.AbortUploadRequest(run="authrun", upload_id="nope"),
    "CommitVersion": pb.CommitVersionRequest(record=pb.VersionRecord(run="authrun", version=1)),
    "StagePart": pb.StagePartRequest(run="authrun", version=2),
    "GetVersion": pb.GetVersionRequest(run="authrun", version=1),
    "GetHead": pb.GetHeadRequest(run="authrun"),
    "ListVersions": pb.ListVersionsRequest(run="authrun"),
    "Watch": pb.WatchRequest(run="authrun", progress_interval_ms=100),
    "PlanCatchUp": pb.PlanCatchUpRequest(run="authrun"),
    "Heartbeat": pb.HeartbeatRequest(
        status=pb.IslandStatus(island_id="i1", run="authrun", state=pb.ISLAND_STATE_READY)
    ),
    "ListIslands": pb.ListIslandsRequest(run="authrun"),
    "ReportTrajectories": pb.ReportTrajectoriesRequest(records=[pb.TrajectoryRecord(run="authrun", island_id="i1")]),
    "ConsumeTrajectories": pb.ConsumeTrajectoriesRequest(run="authrun", group="g", consumer="c"),
    "AckTrajectories": pb.AckTrajectoriesRequest(run="authrun", group="g", ids=["1-0"]),
    "CollectGarbage": pb.CollectGarbageRequest(run="authrun", dry_run=True),
    "CreateToken": pb.CreateTokenRequest(name="x", role=pb.ROLE_READER),
    "RevokeToken": pb.RevokeTokenRequest(token_id="nope"),
}


def test_table_covers_every_method():
    methods = set(pb.DESCRIPTOR.services_by_name["Board"].methods_by_name)
    assert set(METHOD_ROLES) == methods == set(REQUESTS)
    assert all(allowed(m, pb.ROLE_ADMIN) for m in methods)
    assert not allowed("CollectGarbage", pb.ROLE_PUBLISHER)
    assert bearer([("authorization", "Bearer abc")]) == "abc"
    assert bearer([("authorization", "Basic abc")]) is None
    assert bearer([]) is None


async def _call(channel: grpc.aio.Channel, method: str, token: str | None) -> grpc.StatusCode:
    stub = pb_grpc.BoardStub(channel)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        if method == "Watch":
            call = stub.Watch(REQUESTS[method], metadata=metadata, timeout=5)
            async for _ in call:
                break
            call.cancel()
        else:
            await getattr(stub, method)(REQUESTS[method], metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest_asyncio.fixture
async def tokens(board, local_store):
    async with BoardClient(board.address, board.admin_token) as admin:
        out = {name: (await admin.create_token(f"t-{name}", role)).token for name, role in ROLES.items() if name != "ADMIN"}
        out["ADMIN"] = board.admin_token
        await admin.create_run(make_run("authrun"))
        await publish(admin, local_store, "authrun", [1])
    return out


@pytest.mark.parametrize("method", sorted(METHOD_ROLES))
async def test_every_role_refused_where_it_does_not_belong(board, tokens, method):
    async with grpc.aio.insecure_channel(board.address) as channel:
        for name, role in ROLES.items():
            code = await _call(channel, method, tokens[name])
            if allowed(method, role):
                assert code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), (name, code)
            else:
                assert code == grpc.StatusCode.PERMISSION_DENIED, (name, code)
        assert await _call(channel, method, None) == grpc.StatusCode.UNAUTHENTICATED
        assert await _call(channel, method, "wb_not-a-real-token") == grpc.StatusCode.UNAUTHENTICATED


async def test_permission_message_is_actionable(board, tokens):
    async with BoardClient(board.address, tokens["ISLAND"]) as island:
        with pytest.raises(errors.PermissionDenied, match="role ISLAND; CommitVersion needs one of ADMIN, PUBLISHER"):
            await island.commit_version(pb.VersionRecord(run="authrun", version=2))
    async with BoardClient(board.address) as anonymous:
        with pytest.raises(errors.Unauthenticated, match="Bearer"):
            await anonymous.get_head("authrun")


async def test_auth_disabled_mode_is_explicit(board_factory):
    running = await board_factory(auth=False)
    async with BoardClient(running.address) as client:
        await client.create_run(make_run("open"))
        assert (await client.get_head("open")).version == 0


async def test_bootstrap_token_is_stored_hashed(board, redis_url):
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    try:
        blob = b"".join([k + (await r.dump(k) or b"") for k in await r.keys("wb:{tokens}:*")])
    finally:
        await r.aclose()
    assert board.admin_token.encode() not in blob
    assert blob  # the hash is there


async def test_health_and_reflection(board):
    async with grpc.aio.insecure_channel(board.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "weftboard.v1.Board"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = refl.ServerReflectionInfo(timeout=5)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await call.read()
        names = {s.name for s in reply.list_services_response.service}
        assert {"weftboard.v1.Board", "grpc.health.v1.Health"} <= names
        await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol="weftboard.v1.Board"))
        reply = await call.read()
        assert reply.file_descriptor_response.file_descriptor_proto
        await call.done_writing()


async def test_metrics_endpoint(board_factory, local_store):
    running = await board_factory(blobs=local_store, metrics_port=0)
    port = running.handle.metrics_port
    async with BoardClient(running.address, running.admin_token) as client:
        await client.create_run(make_run("m"))
        await publish(client, local_store, "m", [1, 2])
        with pytest.raises(errors.NotFound):
            await client.get_run("absent")
        await client.heartbeat(pb.IslandStatus(island_id="i", run="m", version=2, state=pb.ISLAND_STATE_READY))
        await client.list_islands("m")
        stream = client.watch("m", after_version=2).__aiter__()
        task = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0.3)
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert 'weftboard_rpcs_total{code="OK",method="CommitVersion"} 2.0' in text
    assert 'weftboard_rpcs_total{code="NOT_FOUND",method="GetRun"} 1.0' in text
    assert 'weftboard_rpc_latency_seconds_count{method="CommitVersion"} 2.0' in text
    assert 'weftboard_commits_total{run="m"} 2.0' in text
    assert 'weftboard_head{run="m"} 2.0' in text
    assert 'weftboard_blob_bytes_total{kind="patch"}' in text and 'weftboard_blob_bytes_total{kind="anchor"}' in text
    assert 'weftboard_islands{run="m",state="READY"} 1.0' in text
    assert "weftboard_watch_streams 1.0" in text


def _cert(path: Path, name: str, issuer_key=None, issuer_name=None, ca: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    (path / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (path / f"{name}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return key, cert


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    ca_key, ca_cert = _cert(tmp_path, "ca", ca=True)
    _cert(tmp_path, "server", ca_key, ca_cert.subject)
    _cert(tmp_path, "client", ca_key, ca_cert.subject)
    return tmp_path


async def test_tls(board_factory, pki):
    running = await board_factory(tls_cert=pki / "server.crt", tls_key=pki / "server.key")
    tls = TlsConfig.from_files(root_cert=pki / "ca.crt")
    async with BoardClient(running.address, running.admin_token, tls=tls) as client:
        await client.create_run(make_run("secure"))
        assert (await client.get_head("secure")).version == 0
    async with BoardClient(running.address, running.admin_token, timeout_s=2) as plaintext:
        with pytest.raises(errors.Unavailable):
            await plaintext.get_head("secure")


async def test_mutual_tls(board_factory, pki):
    running = await board_factory(
        tls_cert=pki / "server.crt", tls_key=pki / "server.key", tls_client_ca=pki / "ca.crt"
    )
    ok = TlsConfig.from_files(pki / "ca.crt", pki / "client.crt", pki / "client.key")
    async with BoardClient(running.address, running.admin_token, tls=ok) as client:
        await client.create_run(make_run("mtls"))
    no_cert = TlsConfig.from_files(root_cert=pki / "ca.crt")
    async with BoardClient(running.address, running.admin_token, tls=no_cert, timeout_s=2) as client:
        with pytest.raises(errors.Unavailable):
            await client.get_head("mtls")


async def test_metrics_port_in_use_fails_cleanly(board_factory, local_store):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(errors.Unavailable, match="cannot serve metrics"):
            await board_factory(blobs=local_store, metrics_port=port)


async def test_short_admin_token_is_refused(board_factory):
    with pytest.raises(errors.InvalidArgument, match="at least 16"):
        await board_factory(admin_token="short")
