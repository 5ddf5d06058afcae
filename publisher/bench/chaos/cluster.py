"""The chaos bench's system: real servers and processes, every link through a fault proxy.

What runs (all on loopback, all real processes):
- ``redis-server`` with the append-only file (``appendfsync`` everysec or always);
- SeaweedFS (``weed mini``) as the S3 store;
- ``replicas`` board processes (``weftboard serve``) on that Redis and S3;
- the trainer (``trainer_child``), publishing a tiny model;
- ``islands`` islands, each a reference engine in its own process and ``weftboard sidecar``
  keeping a checkpoint directory the engine loads (on a small tmpfs of its own when the bench
  may mount one, so its disk can be filled).

Every client reaches every server through its own ``FaultProxy``, named ``client>server``
(``island-0>board-1``, ``publisher>s3``, ``board-0>redis``, ...). A server restarted by a
fault comes back on a new port and its proxies are retargeted, so clients keep their
addresses, as behind a load balancer or a DNS name. The ``observer`` links (the bench's own
view of the board) are never faulted.

Invariants:
- ``kill`` is SIGKILL to the real process; ``restart`` starts the same server on the same data
  (Redis replays its AOF, SeaweedFS its data directory, an island its checkpoint directory,
  the trainer its last master weights and the run's head).
- ``stop`` ends every process, proxy and mount it started, also after a failure half-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from weftboard.board.blobs import S3BlobStore
from weftboard.board.client import BoardClient
from weftboard.board.embedded import (
    ManagedProcess,
    free_port,
    redis_server_binary,
    start_seaweedfs,
)
from weftboard.proto.errors import WeftboardError
from weftboard.publisher.bench.chaos.fault_proxy import FaultProxy
from weftboard.publisher.bench.chaos.processes import (
    ChildProcess,
    ProcFigures,
    proc_figures,
)

RUN = "chaos"
# A few hundred KB in bf16 (22 tensors): patches and anchors stay cheap on two shared cores.
MODEL = {"d_model": 96, "n_layers": 2, "n_heads": 4, "d_ff": 192, "max_seq": 64}
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class SystemShape:
    """What the chaos system is made of: the bench's parameters carry one, the cluster is built
    from it."""

    islands: int = 3
    replicas: int = 2
    appendfsync: str = "everysec"
    publish_interval_s: float = 0.25
    anchor_every: int = 8
    island_disk_mb: int = 48


@dataclass
class ClusterConfig:
    root: Path
    seed: int = 0
    shape: SystemShape = field(default_factory=SystemShape)
    log: Callable[[str], None] = print


def _hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _python_env() -> dict[str, str]:
    """The children's environment: no WEFTBOARD_* of the caller, quiet JSON logs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEFTBOARD_")}
    env["WEFTBOARD_LOG_JSON"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash in native code (grpc, torch) leaves its stacks in the log
    return env


class RedisServer:
    """``redis-server`` with AOF in ``dir``; each start on a fresh port."""

    name = "redis"

    def __init__(self, dir: Path, appendfsync: str) -> None:  # noqa: A002
        self.dir = dir
        self.port = 0
        self.appendfsync = appendfsync
        self.child = ChildProcess("redis", self._argv, dir / "redis.log")

    def _argv(self) -> list[str]:
        self.port = free_port()
        return [str(redis_server_binary()), "--port", str(self.port), "--bind", LOOPBACK, "--dir", str(self.dir),
                "--daemonize", "no", "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "",
                "--logfile", ""]

    @property
    def address(self) -> tuple[str, int]:
        return LOOPBACK, self.port

    async def start(self, timeout_s: float = 30.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        await self.child.start()
        deadline = time.monotonic() + timeout_s
        while not await self.ping():
            if not self.child.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING:\n{self.child.log_tail()}")
            await asyncio.sleep(0.05)

    async def ping(self) -> bool:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(LOOPBACK, self.port), 1.0)
        except (OSError, asyncio.TimeoutError):
            return False
        try:
            writer.write(b"PING\r\n")
            return (await asyncio.wait_for(reader.readline(), 1.0)).startswith(b"+PONG")
        except (OSError, asyncio.TimeoutError):
            return False
        finally:
            writer.close()

    def alive(self) -> bool:
        return self.child.alive()

    def kill(self) -> None:
        self.child.kill(signal.SIGKILL)

    async def wait_dead(self) -> None:
        await self.child.wait(10)

    async def stop(self) -> None:
        await self.child.stop()

    def figures(self) -> ProcFigures | None:
        return self.child.figures()


class S3Server:
    """SeaweedFS (``weed mini``) in ``dir``, with fixed credentials across restarts."""

    name = "s3"

    def __init__(self, dir: Path) -> None:  # noqa: A002
        self.dir = dir
        self.proc: ManagedProcess | None = None
        self.access_key = "chaos" + os.urandom(6).hex()
        self.secret_key = os.urandom(20).hex()
        self.bucket = "weftboard"
        self.incarnation = 0
        self.started_at = 0.0
        self.expected_exit = False
        self.starting = False  # weed is being started (in a thread: it takes a second or two)

    async def start(self) -> None:
        self.incarnation += 1
        self.expected_exit = False
        self.starting = True
        self.started_at = time.monotonic()
        try:
            self.proc = await asyncio.to_thread(start_seaweedfs, self.dir, access_key=self.access_key,
                                                secret_key=self.secret_key, bucket=self.bucket)
        finally:
            self.starting = False

    @property
    def address(self) -> tuple[str, int]:
        assert self.proc is not None
        return _hostport(self.proc.endpoint)

    def store(self) -> S3BlobStore:
        """A client straight to the server (not through a proxy): the bench's own hands."""
        assert self.proc is not None
        return S3BlobStore(self.proc.endpoint, self.access_key, self.secret_key, self.bucket, region="us-east-1")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def kill(self) -> None:
        if self.alive():
            self.expected_exit = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]

    async def wait_dead(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(self.proc.process.wait, 10)
            await asyncio.to_thread(self.proc.stop)  # reaps it and closes its log

    async def stop(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop)

    def figures(self) -> ProcFigures | None:
        return proc_figures(self.proc.pid) if self.alive() else None  # type: ignore[union-attr]


@dataclass
class Island:
    """An engine process (never killed: a GPU engine outlives its sidecar) and its sidecar."""

    island_id: str
    dir: Path
    engine: ChildProcess
    engine_url: str
    url: str | None = None  # the sidecar's, once it said where it serves
    mounted: bool = False
    serving: asyncio.Event = field(default_factory=asyncio.Event)
    sidecar: ChildProcess = field(init=False)

    @property
    def checkpoint(self) -> Path:
        return self.dir / "checkpoint"


class Cluster:
    """Start, kill and restart the system's processes; own its proxies and mounts."""

    def __init__(self, cfg: ClusterConfig, admin_token: str, on_trainer_line: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.token = admin_token
        root = cfg.root
        self.redis = RedisServer(root / "redis", cfg.shape.appendfsync)
        self.s3 = S3Server(root / "s3")
        self.proxies: dict[str, FaultProxy] = {}
        self.boards: list[ChildProcess] = []
        self.board_addresses: list[str] = []  # each replica's own address (its current incarnation)
        self.island_ids = [f"island-{i}" for i in range(cfg.shape.islands)]
        self.clients = ["publisher", "consumer", "observer", *self.island_ids]
        self.islands: list[Island] = []
        self.trainer_resume = "run"
        self.trainer = ChildProcess("publisher", self._trainer_argv, root / "publisher.log", env=_python_env(),
                                    on_line=on_trainer_line)
        self.disk_full_possible = False

    # -- proxies --------------------------------------------------------------------------

    async def _proxy(self, name: str, target: tuple[str, int]) -> FaultProxy:
        proxy = await FaultProxy(name, target).start()
        self.proxies[name] = proxy
        return proxy

    def links(self, pattern: str) -> list[FaultProxy]:
        """The proxies whose names match ``pattern`` (fnmatch: ``island-1>board-*``)."""
        return [p for name, p in self.proxies.items() if fnmatch.fnmatchcase(name, pattern)]

    def faultable_links(self) -> list[str]:
        return sorted(name for name in self.proxies if not name.startswith("observer>"))

    def boards_for(self, client: str) -> str:
        """The board replicas' addresses as ``client`` dials them (through its proxies)."""
        return ",".join(self.proxies[f"{client}>board-{j}"].address for j in range(self.cfg.shape.replicas))

    def s3_for(self, client: str) -> str:
        return self.proxies[f"{client}>s3"].address

    # -- argv ---------------------------------------------------------------------------

    def _board_argv(self, j: int) -> Callable[[], list[str]]:
        def argv() -> list[str]:
            address = f"{LOOPBACK}:{free_port()}"
            self.board_addresses[j] = address
            return [sys.executable, "-m", "weftboard.board.cli", "serve", "--listen", address,
                    "--redis-url", f"redis://{self.proxies[f'board-{j}>redis'].address}/0",
                    "--s3-endpoint", self.proxies[f"board-{j}>s3"].address, "--s3-access-key", self.s3.access_key,
                    "--s3-secret-key", self.s3.secret_key, "--s3-bucket", self.s3.bucket, "--s3-insecure",
                    "--s3-region", "us-east-1", "--admin-token", self.token,
                    "--data-dir", str(self.cfg.root / f"board-{j}" / "data"), "--log-level", "WARNING", "--log-json"]
        return argv

    def _trainer_argv(self) -> list[str]:
        return [sys.executable, "-m", "weftboard.publisher.bench.chaos.trainer_child",
                "--board", self.boards_for("publisher"), "--run", RUN, "--token", self.token,
                "--s3-endpoint", self.s3_for("publisher"), "--s3-access-key", self.s3.access_key,
                "--s3-secret-key", self.s3.secret_key, "--s3-bucket", self.s3.bucket,
                "--state-dir", str(self.cfg.root / "trainer"), "--model", json.dumps(MODEL),
                "--seed", str(self.cfg.seed), "--anchor-every", str(self.cfg.shape.anchor_every),
                "--interval-s", str(self.cfg.shape.publish_interval_s), "--resume", self.trainer_resume]

    def _sidecar_argv(self, island: Island) -> Callable[[], list[str]]:
        def argv() -> list[str]:
            client = island.island_id
            return [sys.executable, "-m", "weftboard.board.cli", "sidecar", "--board", self.boards_for(client),
                    "--token", self.token, "--run", RUN, "--engine", "reference", "--engine-url", island.engine_url,
                    "--listen", f"{LOOPBACK}:0", "--dir", str(island.dir), "--island-id", client,
                    "--deadline-ms", "5000", "--s3-endpoint", self.s3_for(client),
                    "--s3-access-key", self.s3.access_key, "--s3-secret-key", self.s3.secret_key,
                    "--s3-bucket", self.s3.bucket, "--log-json"]
        return argv

    # -- start ----------------------------------------------------------------------------

    async def start(self) -> None:
        say = self.cfg.log
        await self.redis.start()
        await self.s3.start()
        say(f"redis-server (AOF, appendfsync {self.cfg.shape.appendfsync}) on {self.redis.port}, "
            f"SeaweedFS S3 on {self.s3.address[1]}")
        for j in range(self.cfg.shape.replicas):
            await self._proxy(f"board-{j}>redis", self.redis.address)
            await self._proxy(f"board-{j}>s3", self.s3.address)
        for client in ("publisher", *self.island_ids):
            await self._proxy(f"{client}>s3", self.s3.address)
        for j in range(self.cfg.shape.replicas):
            for client in self.clients:
                await self._proxy(f"{client}>board-{j}", None)  # targeted once the board is up
            self.board_addresses.append("")
            self.boards.append(ChildProcess(f"board-{j}", self._board_argv(j), self.cfg.root / f"board-{j}.log",
                                            env=_python_env()))
        await asyncio.gather(*(self.start_board(j) for j in range(self.cfg.shape.replicas)))
        say(f"{self.cfg.shape.replicas} board replicas at {', '.join(self.board_addresses)}; "
            f"{len(self.proxies)} fault proxies")
        await self.trainer.start()

    async def start_board(self, j: int, timeout_s: float = 90.0) -> None:
        board = self.boards[j]
        self.detach(f"board-{j}")
        await board.start()
        async with BoardClient(self.board_addresses[j], self.token, timeout_s=5) as client:
            deadline = time.monotonic() + timeout_s
            while True:
                if not board.alive():
                    raise RuntimeError(f"board-{j} exited during start-up:\n{board.log_tail()}")
                try:
                    await client.wait_ready(timeout_s=1.0)
                    await client.list_runs()
                    break
                except WeftboardError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"board-{j} not ready in {timeout_s:.0f}s:\n{board.log_tail()}") from None
                    await asyncio.sleep(0.1)
        for proxy in self.links(f"*>board-{j}"):
            proxy.retarget(_hostport(self.board_addresses[j]))

    async def start_islands(self) -> None:
        """Engines and sidecars; each island's directory on a tmpfs of its own if we may mount one."""
        config_path = self.cfg.root / "model.json"
        config_path.write_text(json.dumps(MODEL))
        for island_id in self.island_ids:
            directory = self.cfg.root / "islands" / island_id
            directory.mkdir(parents=True, exist_ok=True)
            mounted = self._mount_tmpfs(directory)
            engine_port = free_port()
            engine = ChildProcess(f"engine-{island_id}", lambda port=engine_port: [
                sys.executable, "-m", "weftboard.subscriber.reference_engine.openai_api",
                "--listen", f"{LOOPBACK}:{port}", "--config", str(config_path)],
                self.cfg.root / f"engine-{island_id}.log", env=_python_env())
            island = Island(island_id, directory, engine, f"http://{LOOPBACK}:{engine_port}", mounted=mounted)
            island.sidecar = ChildProcess(island_id, self._sidecar_argv(island), self.cfg.root / f"{island_id}.log",
                                          env=_python_env(), on_line=self._sidecar_line(island))
            self.islands.append(island)
        self.disk_full_possible = all(i.mounted for i in self.islands)
        await asyncio.gather(*(i.engine.start() for i in self.islands))
        await asyncio.gather(*(self.start_sidecar(i) for i in self.islands))

    def _sidecar_line(self, island: Island) -> Callable[[str], None]:
        def on_line(line: str) -> None:
            found = re.search(r"serving on (http://\S+)", line)
            if found:
                island.url = found.group(1)
                island.serving.set()
        return on_line

    async def start_sidecar(self, island: Island) -> None:
        island.url = None
        island.serving = asyncio.Event()
        await island.sidecar.start()

    def island(self, island_id: str) -> Island:
        return next(i for i in self.islands if i.island_id == island_id)

    def _mount_tmpfs(self, directory: Path) -> bool:
        if os.geteuid() != 0:
            return False
        try:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.cfg.shape.island_disk_mb}m", "tmpfs", str(directory)],
                           check=True, capture_output=True, timeout=10)
            return True
        except (OSError, subprocess.SubprocessError):
            return False

    # -- kill and restart -----------------------------------------------------------------

    def detach(self, server: str) -> None:
        """``server`` (``redis``, ``s3``, ``board-1``) is down: its proxies refuse until it is back, so no
        client reaches whatever process takes its old port meanwhile (a restarted server's new ports)."""
        for proxy in self.links(f"*>{server}"):
            proxy.retarget(None)

    async def restart_redis(self) -> None:
        self.detach("redis")
        await self.redis.start()
        for proxy in self.links("*>redis"):
            proxy.retarget(self.redis.address)

    async def restart_s3(self) -> None:
        self.detach("s3")
        await self.s3.start()
        for proxy in self.links("*>s3"):
            proxy.retarget(self.s3.address)

    # -- stop -------------------------------------------------------------------------------

    async def stop(self) -> None:
        for island in self.islands:
            with contextlib.suppress(Exception):
                await island.sidecar.stop(grace_s=10)
            with contextlib.suppress(Exception):
                await island.engine.stop(grace_s=5)
        with contextlib.suppress(Exception):
            await self.trainer.stop(grace_s=10)
        for board in self.boards:
            with contextlib.suppress(Exception):
                await board.stop(grace_s=10)
        for proxy in self.proxies.values():
            with contextlib.suppress(Exception):
                await proxy.close()
        with contextlib.suppress(Exception):
            await self.s3.stop()
        with contextlib.suppress(Exception):
            await self.redis.stop()
        for island in self.islands:
            if island.mounted:
                subprocess.run(["umount", "-l", str(island.dir)], capture_output=True, timeout=10, check=False)
                island.mounted = False
