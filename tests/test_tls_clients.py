"""Every client of the board over TLS and mutual TLS, against a real ``weftboard serve``.

The certificates (a CA, a server certificate for localhost/127.0.0.1, a client certificate, and
a second CA that signed neither) are made at test time with the ``cryptography`` package, or
the ``openssl`` command when that package is missing. The board runs as its own process with
``--tls-cert/--tls-key/--tls-client-ca`` on the test's Redis and the session's S3 server, so the
publisher uploads and the islands download through presigned URLs, as deployed.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch
from boardkit import make_run
from pubsubkit import bits_equal, follow_each

from weftboard.board.channel import TlsConfig, client_tls, unavailable_message
from weftboard.board.client import BoardClient
from weftboard.board.embedded import ManagedProcess, free_port
from weftboard.proto.errors import InvalidArgument, Unavailable
from weftboard.publisher.publisher import Publisher
from weftboard.publisher.trajectories import SyncTrajectoryConsumer
from weftboard.subscriber.demo.rl_loop import Trainer
from weftboard.subscriber.engine_island import REFERENCE_CONFIG_LABEL, start_island

WEFTBOARD = [sys.executable, "-m", "weftboard.board.cli"]
MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq": 32}
RUN = "tls-run"


# ---------------------------------------------------------------------------
# Certificates
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """The files ``make_pki`` wrote: ``<name>.crt`` and ``<name>.key`` for ca, server, client, other."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def other_crt(self) -> Path:
        return self.dir / "other.crt"

    @property
    def server_crt(self) -> Path:
        return self.dir / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.dir / "server.key"

    @property
    def client_crt(self) -> Path:
        return self.dir / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.dir / "client.key"


def _pki_with_cryptography(path: Path) -> None:
    from cryptography import x509  # noqa: PLC0415  (optional: openssl is the fallback)
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    def cert(name: str, issuer: tuple | None = None, *, ca: bool = False, san: bool = False) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(issuer[1].subject if issuer else subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        certificate = builder.sign(issuer[0] if issuer else key, hashes.SHA256())
        (path / f"{name}.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        (path / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return key, certificate

    ca = cert("ca", ca=True)
    cert("server", ca, san=True)
    cert("client", ca)
    cert("other", ca=True)


def _pki_with_openssl(path: Path) -> None:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=path, check=True, capture_output=True, timeout=60)

    def key_and_request(name: str, *extra: str) -> None:
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                f"{name}.key", "-subj", f"/CN={name}", *extra)

    for ca in ("ca", "other"):
        key_and_request(ca, "-x509", "-days", "1", "-out", f"{ca}.crt",
                        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    (path / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    (path / "client.ext").write_text("basicConstraints=CA:FALSE\n")
    for name in ("server", "client"):
        key_and_request(name, "-out", f"{name}.csr")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-out", f"{name}.crt", "-extfile", f"{name}.ext")


def make_pki(path: Path, *, tool: str | None = None) -> Pki:
    """CA, server (localhost, 127.0.0.1) and client certificates, and an unrelated CA, in ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    if tool is None:
        try:
            import cryptography  # noqa: F401, PLC0415  (optional)
            tool = "cryptography"
        except ImportError:
            tool = "openssl"
    if tool == "openssl":
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available")
        _pki_with_openssl(path)
    else:
        _pki_with_cryptography(path)
    return Pki(path)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


# ---------------------------------------------------------------------------
# A TLS board as its own process, and the CLI
# ---------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEFTBOARD_")}
    env.update(COLUMNS="200", NO_COLOR="1", **extra)
    return env


class TlsBoard:
    """``weftboard serve`` with TLS (mutual with ``client_ca``) on a given Redis and S3."""

    def __init__(self, tmp: Path, redis_url: str, s3: ManagedProcess, pki: Pki, *, mutual: bool = True) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.admin = "admin-" + uuid.uuid4().hex
        args = ["serve", "--listen", self.address, "--redis-url", redis_url, "--data-dir", str(tmp / "data"),
                "--admin-token", self.admin, "--s3-endpoint", s3.endpoint, "--s3-access-key", s3.access_key,
                "--s3-secret-key", s3.secret_key, "--s3-bucket", s3.bucket, "--s3-region", "us-east-1",
                "--s3-prefix", f"tls-{uuid.uuid4().hex[:8]}",
                "--tls-cert", str(pki.server_crt), "--tls-key", str(pki.server_key)]
        if mutual:
            args += ["--tls-client-ca", str(pki.ca_crt)]
        self.proc = subprocess.Popen([*WEFTBOARD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=_env())
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"serve exited ({self.proc.wait()}):\n{''.join(lines)}\n{self.proc.stderr.read()}")
            lines.append(line)
            if line.startswith("data dir"):
                break
        self.banner = "".join(lines)
        assert "(TLS)" in self.banner, self.banner

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def mtls_board(tmp_path: Path, redis_url: str, s3_server: ManagedProcess, pki: Pki):
    board = TlsBoard(tmp_path, redis_url, s3_server, pki)
    try:
        yield board
    finally:
        board.stop()


async def weftboard(*args: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> tuple[int, str, str]:
    """``weftboard ARGS`` as its own process: exit status, stdout, stderr (the event loop keeps running)."""
    proc = await asyncio.create_subprocess_exec(*WEFTBOARD, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=env or _env())
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode(), err.decode()


def mtls_flags(pki: Pki) -> list[str]:
    return ["--tls-ca", str(pki.ca_crt), "--tls-cert", str(pki.client_crt), "--tls-key", str(pki.client_key)]


# ---------------------------------------------------------------------------
# The whole loop over mutual TLS
# ---------------------------------------------------------------------------


async def _complete(url: str, constraint: str, request_id: str) -> tuple[int, dict]:
    headers = {"X-Weftboard-Version": constraint, "X-Request-Id": request_id, "X-Weftboard-Deadline-Ms": "5000"}
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/completions", json={"prompt": "say ab:", "max_tokens": 4, "seed": 0}, headers=headers,
            timeout=aiohttp.ClientTimeout(total=30)) as response:
        return response.status, await response.json()


@pytest.mark.slow
@pytest.mark.usefixtures("warm_kernels")
@pytest.mark.timeout(600)
async def test_the_whole_loop_over_mutual_tls(mtls_board: TlsBoard, pki: Pki, tmp_path: Path) -> None:
    """Publisher -> board -> island (subscriber, sidecar, engine) -> trajectories -> trainer, every
    hop to the board over mutual TLS; ``weftboard subscribe`` and the read commands too."""
    address, admin = mtls_board.address, mtls_board.admin
    mtls = {"tls_ca": pki.ca_crt, "tls_cert": pki.client_crt, "tls_key": pki.client_key}
    trainer = Trainer(MODEL, lr=1e-2)
    views: dict[int, dict[str, torch.Tensor]] = {}
    publisher = Publisher(address, RUN, token=admin, anchor_every=4, work_dir=tmp_path / "pub",
                          run_labels={REFERENCE_CONFIG_LABEL: json.dumps(trainer.config)}, **mtls)

    def publish() -> int:
        if views:
            loss = sum((p.float() ** 2).mean() for p in trainer.params.values())
            trainer.opt.zero_grad()
            loss.backward()
            trainer.opt.step()
        version = publisher.publish(trainer.state_dict(), step=len(views)).version
        publisher.flush(60)
        views[version] = trainer.served_view()
        return version

    island = None
    try:
        for _ in range(3):
            await asyncio.to_thread(publish)
        assert sorted(views) == [1, 2, 3]

        # an island with its sidecar: watch, plan, presigned downloads, heartbeats, trajectories
        island = await start_island(board=address, token=admin, run=RUN, island_id="tls-island",
                                    cache_dir=tmp_path / "island", heartbeat_s=0.5, default_deadline_s=5.0,
                                    tls=TlsConfig.from_files(pki.ca_crt, pki.client_crt, pki.client_key))
        await island.subscriber.wait_for_version(3, timeout_s=60)
        assert bits_equal(island.engine.tensors, views[3])
        status, body = await _complete(island.url, "exact=3", "tls-1")
        assert status == 200 and body["weftboard"]["version_start"] == 3, body
        await island.sidecar.reporter.flush()

        # the trainer's synchronous trajectory consumer
        def consume() -> list:
            with SyncTrajectoryConsumer(address, RUN, "trainer", "c0", token=admin, block_ms=500, **mtls) as c:
                got: list = []
                for _ in range(20):
                    got += c.poll()
                    if got:
                        break
                assert c.ack(got) == len(got)
                return got

        got = await asyncio.to_thread(consume)
        assert [(t.request_id, t.version) for t in got] == [("tls-1", 3)]

        # the subscriber library on its own client: every version bitwise
        async with BoardClient(address, admin, **mtls) as client:
            await follow_each(client, RUN, None, tmp_path, views, presigned=True)

        # `weftboard subscribe` in its own process, its TLS options from the environment
        env = _env(WEFTBOARD_TLS_CA=str(pki.ca_crt), WEFTBOARD_TLS_CLIENT_CERT=str(pki.client_crt),
                   WEFTBOARD_TLS_CLIENT_KEY=str(pki.client_key))
        code, out, err = await weftboard("subscribe", "--board", address, "--token", admin, "--run", RUN,
                                         "--dir", str(tmp_path / "cli-island"), "--island-id", "cli-island",
                                         "--destination", "memory", "--events", "--exit-at-version", "3",
                                         "--no-progress", env=env)
        assert code == 0, err[-3000:]
        applied = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [e["version"] for e in applied if e["event"] == "applied"][-1] == 3

        # the read commands, flags this time
        code, out, err = await weftboard("history", RUN, "--json", "--board", address, "--token", admin,
                                         *mtls_flags(pki))
        assert code == 0, err
        assert [v["version"] for v in json.loads(out)["versions"]] == [1, 2, 3]
        code, out, err = await weftboard("status", RUN, "--json", "--board", address, "--token", admin,
                                         *mtls_flags(pki))
        assert code == 0, err
        fleet = json.loads(out)
        assert fleet["head"] == 3
        assert {i["island_id"]: i["version"] for i in fleet["islands"]}["tls-island"] == 3
    finally:
        if island is not None:
            await island.stop()
        await asyncio.to_thread(publisher.close, flush=False)


# ---------------------------------------------------------------------------
# Failures say what failed
# ---------------------------------------------------------------------------


async def test_a_client_without_the_ca_fails_clearly(board_factory, pki: Pki) -> None:
    running = await board_factory(tls_cert=pki.server_crt, tls_key=pki.server_key)
    address = running.address
    async with BoardClient(address, running.admin_token, tls_ca=pki.ca_crt) as client:
        await client.create_run(make_run("secure"))
    for options in ({"tls": True}, {"tls_ca": pki.other_crt}):  # the system's roots; a CA that signed nothing here
        async with BoardClient(address, running.admin_token, timeout_s=5, **options) as client:
            with pytest.raises(Unavailable) as failed:
                await client.get_head("secure")
        assert f"TLS with the board at {address} failed" in str(failed.value), failed.value
        assert "--tls-ca" in str(failed.value)
    async with BoardClient(address, running.admin_token, timeout_s=5) as plaintext:
        with pytest.raises(Unavailable, match=f"the board at {address} closed the connection; if it serves TLS"):
            await plaintext.get_head("secure")
    # the server name: the certificate names localhost and 127.0.0.1, not another host
    async with BoardClient(address, running.admin_token, tls_ca=pki.ca_crt, server_name="localhost") as client:
        assert (await client.get_head("secure")).version == 0
    async with BoardClient(address, running.admin_token, timeout_s=5, tls_ca=pki.ca_crt,
                           server_name="elsewhere.example") as client:
        with pytest.raises(Unavailable, match="--tls-server-name"):
            await client.get_head("secure")

    code, _, err = await weftboard("status", "--board", address, "--token", running.admin_token, "--tls")
    assert code == 1 and "UNAVAILABLE" in err and f"TLS with the board at {address} failed" in err, err
    code, out, err = await weftboard("status", "secure", "--json", "--board", address,
                                     "--token", running.admin_token, "--tls-ca", str(pki.ca_crt))
    assert code == 0 and json.loads(out)["run"] == "secure", err


async def test_mutual_tls_refuses_a_client_without_a_certificate(board_factory, pki: Pki) -> None:
    running = await board_factory(tls_cert=pki.server_crt, tls_key=pki.server_key, tls_client_ca=pki.ca_crt)
    address, token = running.address, running.admin_token
    async with BoardClient(address, token, tls_ca=pki.ca_crt, tls_cert=pki.client_crt,
                           tls_key=pki.client_key) as client:
        await client.create_run(make_run("mtls"))
    async with BoardClient(address, token, tls_ca=pki.ca_crt, timeout_s=5) as client:
        with pytest.raises(Unavailable) as refused:
            await client.get_head("mtls")
    assert f"TLS with the board at {address} failed" in str(refused.value)
    assert "client certificate" in str(refused.value)
    code, _, err = await weftboard("history", "mtls", "--board", address, "--token", token, "--tls-ca", str(pki.ca_crt))
    assert code == 1 and "client certificate" in err, err
    code, out, err = await weftboard("history", "mtls", "--json", "--board", address, "--token", token,
                                     *mtls_flags(pki))
    assert code == 0 and json.loads(out) == {"run": "mtls", "versions": []}, err


async def test_tls_files_are_named_when_they_cannot_be_used(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "ca.pem"
    not_pem = tmp_path / "garbage.pem"
    not_pem.write_text("not a certificate\n")
    with pytest.raises(InvalidArgument, match=f"TLS CA bundle.*{missing}"):
        BoardClient("127.0.0.1:1", tls_ca=missing)
    with pytest.raises(InvalidArgument, match=f"{not_pem}.*no PEM data"):
        client_tls(tls_ca=not_pem)
    with pytest.raises(InvalidArgument, match="tls_cert is set, tls_key is not"):
        client_tls(tls_ca=pki.ca_crt, tls_cert=pki.client_crt)
    with pytest.raises(InvalidArgument, match=f"TLS client key.*{missing}"):
        Publisher("127.0.0.1:1", "r", tls_cert=pki.client_crt, tls_key=missing)
    with pytest.raises(InvalidArgument, match=f"TLS CA bundle.*{missing}"):
        SyncTrajectoryConsumer("127.0.0.1:1", "r", "g", "c", tls_ca=missing)
    assert client_tls() is None and client_tls(False) is None
    assert client_tls(True) == TlsConfig()  # the system's roots
    assert client_tls(server_name="board.example") == TlsConfig(server_name="board.example")
    for command in (["status"], ["subscribe", "--run", "r", "--dir", str(tmp_path / "d")], ["sidecar", "--run", "r"]):
        code, _, err = await weftboard(*command, "--board", "127.0.0.1:1", "--tls-ca", str(missing))
        assert code == 2 and str(missing) in err and "Traceback" not in err, err


def test_unavailable_messages_name_the_address() -> None:
    tls = TlsConfig(root_cert=b"-----BEGIN CERTIFICATE-----")
    handshake = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.1:7420: Tls handshake "
                 "failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED")
    assert unavailable_message("b:7420", tls, handshake).startswith("TLS with the board at b:7420 failed")
    refused = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.1:7420: Connection refused"
    assert unavailable_message("b:7420", tls, refused).startswith("board at b:7420 unreachable")
    # an UNAVAILABLE the board itself sent keeps its message (its Redis is away, not the board)
    assert unavailable_message("b:7420", tls, "Redis unreachable: certificate expired") == (
        "Redis unreachable: certificate expired")


async def test_openssl_made_certificates_serve_mutual_tls(board_factory, tmp_path: Path) -> None:
    """The ``openssl`` fallback of ``make_pki`` makes certificates the board and clients accept."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    made = make_pki(tmp_path / "openssl-pki", tool="openssl")
    running = await board_factory(tls_cert=made.server_crt, tls_key=made.server_key, tls_client_ca=made.ca_crt)
    async with BoardClient(running.address, running.admin_token, tls_ca=made.ca_crt, tls_cert=made.client_crt,
                           tls_key=made.client_key) as client:
        await client.create_run(make_run("openssl"))
        assert (await client.get_head("openssl")).version == 0
