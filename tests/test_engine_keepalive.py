"""An engine adapter never sends a request on a connection the engine has already closed.

The engine here is a plain socket server that, like uvicorn, closes an idle keep-alive
connection after a short while. The client's event loop is blocked past that moment (as a
synchronous generation call in a test or a busy island does), so the closing is not seen
before the next request. aiohttp's default pool (15 s) reuses the dead connection and the
request fails with "Server disconnected"; the adapter's pool drops it first. The requests
are POSTs, as the weight-update RPCs are: aiohttp retries an idempotent GET once by itself.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.engines.vllm import VllmAdapter

SERVER_IDLE_CLOSE_S = 0.2  # the engine closes an idle connection after this
BLOCKED_S = 0.8  # the client's loop does not run for this long between two requests

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n{}"


def _serve_one_connection(conn: socket.socket) -> None:
    """Answer every request that arrives within the idle window, then close like uvicorn."""
    with conn:
        conn.settimeout(SERVER_IDLE_CLOSE_S)
        buffered = b""
        while True:
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                return  # idle past the keep-alive window: close
            if not chunk:
                return
            buffered += chunk
            while b"\r\n\r\n" in buffered:
                _, buffered = buffered.split(b"\r\n\r\n", 1)
                conn.sendall(RESPONSE)


@pytest.fixture
def closing_engine() -> Iterator[tuple[str, list[int]]]:
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[int] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            connections.append(1)
            threading.Thread(target=_serve_one_connection, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", connections
    stop.set()
    thread.join(2)
    listener.close()


async def _two_calls_with_blocked_loop(adapter: VllmAdapter) -> None:
    try:
        assert await adapter.call("POST", "/collective_rpc", json={"method": "ping"}) == {}
        time.sleep(BLOCKED_S)  # the loop is blocked: the engine's close is not seen yet
        assert await adapter.call("POST", "/collective_rpc", json={"method": "ping"}) == {}
    finally:
        await adapter.close()


async def test_an_idle_connection_is_dropped_before_the_engine_closes_it(closing_engine) -> None:
    url, connections = closing_engine
    await _two_calls_with_blocked_loop(VllmAdapter(url, keepalive_s=SERVER_IDLE_CLOSE_S / 2))
    assert len(connections) == 2  # the second request went out on a new connection


async def test_a_pool_that_outlives_the_engines_keepalive_fails_so(closing_engine) -> None:
    """The failure the adapter's short pool avoids (aiohttp's default keeps 15 s)."""
    url, _ = closing_engine
    with pytest.raises(ApplyError, match="Server disconnected|unreachable"):
        await _two_calls_with_blocked_loop(VllmAdapter(url, keepalive_s=15.0))


def test_the_default_pool_is_shorter_than_uvicorns_keepalive() -> None:
    assert VllmAdapter("http://127.0.0.1:1").keepalive_s < 5.0
