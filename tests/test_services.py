"""The real-server launchers: they start, answer, keep data where told, and stop cleanly."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
from minio import Minio

from weftboard.board.embedded import (
    free_port,
    free_port_pair,
    redis_server_binary,
    start_redis,
    start_seaweedfs,
    weed_binary,
)
from weftboard.proto.errors import Unavailable


def _pid_gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie still answers kill(0); treat it as gone once it is not running
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    pair = free_port_pair()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", pair))
        b.bind(("127.0.0.1", pair + 10000))


def test_binaries_are_found() -> None:
    assert os.access(redis_server_binary(), os.X_OK)
    assert os.access(weed_binary(), os.X_OK)


def test_redis_starts_answers_and_stops(tmp_path: Path) -> None:
    with start_redis(tmp_path) as server:
        assert server.url.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
        pid = server.pid
    assert _pid_gone(pid)
    assert (tmp_path / "redis.log").stat().st_size > 0
    server.stop()  # idempotent


def test_redis_persistent_keeps_data_across_restart(tmp_path: Path) -> None:
    with start_redis(tmp_path, persistent=True) as server:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        client.xadd("events", {"v": "1"})
        client.close()
    # SIGTERM makes redis flush its append-only file before exiting.
    with start_redis(tmp_path, persistent=True) as again:
        client = redis.Redis.from_url(again.url, socket_timeout=5)
        assert client.xlen("events") == 1
        client.close()


def test_two_redis_instances_do_not_collide(tmp_path: Path) -> None:
    with start_redis(tmp_path / "a") as a, start_redis(tmp_path / "b") as b:
        assert a.port != b.port
        ra, rb = redis.Redis.from_url(a.url), redis.Redis.from_url(b.url)
        ra.set("who", "a")
        assert rb.get("who") is None
        ra.close(), rb.close()


def test_redis_on_a_taken_port_fails_with_log(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(Unavailable, match="redis-server could not start on port"):
            start_redis(tmp_path, port=port)


def test_servers_die_with_their_parent(tmp_path: Path) -> None:
    """A process that starts Redis and is killed does not leave the server behind."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from weftboard.board.embedded import start_redis
        proc = start_redis(Path({str(tmp_path)!r}))
        print(proc.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert _pid_gone(child_pid), "redis-server outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_seaweedfs_serves_s3_with_credentials(s3_server) -> None:
    client = Minio(s3_server.endpoint, access_key=s3_server.access_key, secret_key=s3_server.secret_key,
                   secure=False, region="us-east-1")
    assert client.bucket_exists(s3_server.bucket)
    client.put_object(s3_server.bucket, "probe/x", io.BytesIO(b"abc"), 3)
    assert client.get_object(s3_server.bucket, "probe/x").read() == b"abc"
    client.remove_object(s3_server.bucket, "probe/x")
    wrong = Minio(s3_server.endpoint, access_key="nobody", secret_key="wrong-secret", secure=False,
                  region="us-east-1")
    with pytest.raises(Exception, match="InvalidAccessKeyId|AccessDenied|SignatureDoesNotMatch"):
        wrong.list_buckets()
    for port in s3_server.ports.values():
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_second_seaweedfs_beside_the_session_one(s3_server, tmp_path: Path) -> None:
    with start_seaweedfs(tmp_path, bucket="second") as other:
        assert set(other.ports.values()).isdisjoint(s3_server.ports.values())
        client = Minio(other.endpoint, access_key=other.access_key, secret_key=other.secret_key,
                       secure=False, region="us-east-1")
        assert client.bucket_exists("second")
        pid = other.pid
    assert _pid_gone(pid)
    assert (tmp_path / "weed.log").exists()


def test_servers_stop_at_interpreter_exit(tmp_path: Path) -> None:
    """A process that forgets stop() still leaves no server behind (atexit)."""
    script = textwrap.dedent(
        f"""
        import threading
        from pathlib import Path
        from weftboard.board.embedded import start_redis
        holder = {{}}
        # started from a worker thread: no parent-death signal, only atexit cleans up
        t = threading.Thread(target=lambda: holder.update(p=start_redis(Path({str(tmp_path)!r}))))
        t.start(); t.join()
        print(holder["p"].pid, flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert _pid_gone(int(result.stdout.strip())), "redis-server outlived an interpreter that exited normally"


def test_missing_binary_is_a_clear_error() -> None:
    from weftboard.board import embedded as services
    from weftboard.proto.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match="cannot find the 'no-such-server-binary' executable"):
        services._find_binary("no-such-server-binary", lambda: [])
