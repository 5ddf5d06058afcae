"""A delaying TCP relay: the propagation delay of a simulated WAN link.

The kernel's ``netem`` qdisc is not available everywhere we run, so latency is added in user
space: every connection accepted on the listening socket is forwarded to one fixed target, and
each chunk read in either direction is released to the other side no earlier than
``arrival + delay``.

Invariants:
- Bytes are forwarded intact and in order: one FIFO queue per direction, one writer per queue.
- Delay is per chunk, not per round trip: the reader keeps reading while earlier chunks wait, so
  throughput is bounded by the link (and ``max_chunks_in_flight * chunk_bytes`` per delay), never
  serialised to one chunk per delay.
- Memory is bounded: each direction holds at most ``max_chunks_in_flight`` chunks; a full queue
  stops the reader, which is TCP backpressure towards the sender.
- With ``slow_start``, each direction also obeys a TCP congestion window over the simulated
  round trip (``window.SlowStartWindow``): the relay terminates TCP, so the real connections
  would otherwise never feel the round trip in their ramp-up; with ``loss`` that window also
  loses segments at random (a late delivery and a smaller window, see ``window.py``).
- Half-close is propagated (EOF in one direction becomes ``write_eof`` on the other); an error in
  either direction aborts both sides.
- ``close()`` stops listening and ends every live connection, so the relay never outlives its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable

import structlog

from weftboard.publisher.bench.wan.window import SlowStartWindow, check_loss

log = structlog.get_logger(__name__)

SocketFactory = Callable[[], Awaitable[socket.socket]]

CHUNK_BYTES = 64 * 1024

# Prefix of the relay process's protocol lines on stdout (see relayd). It lives here, not in
# relayd, so the owner never imports the module it runs with ``python -m``.
MARKER = "WANRELAY"


class DelayRelay:
    """Forward every accepted connection to ``target``, adding ``delay_s`` each way.

    ``listen_sock`` is an already bound socket (so the caller can create it inside another
    network namespace); ``make_socket`` creates the outgoing socket (likewise). Both default to
    ordinary sockets in this process's namespace.
    """

    def __init__(
        self,
        target: tuple[str, int],
        delay_s: float,
        *,
        listen: tuple[str, int] | None = None,
        listen_sock: socket.socket | None = None,
        make_socket: SocketFactory | None = None,
        connect_timeout_s: float = 10.0,
        max_chunks_in_flight: int = 256,
        chunk_bytes: int = CHUNK_BYTES,
        slow_start: bool = False,
        loss: float = 0.0,
    ) -> None:
        if (listen is None) == (listen_sock is None):
            raise ValueError("give exactly one of listen=(host, port) or listen_sock=")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.target = target
        self.delay_s = delay_s
        self._listen = listen
        self._listen_sock = listen_sock
        self._make_socket = make_socket
        self._connect_timeout_s = connect_timeout_s
        self._max_chunks = max_chunks_in_flight
        self._chunk_bytes = chunk_bytes
        self.slow_start = slow_start and delay_s > 0
        check_loss(loss, self.slow_start)
        self.loss = loss
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.bytes_forwarded = 0

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the relay listens on; valid after ``start()``."""
        if self._server is None:
            raise RuntimeError("relay not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> DelayRelay:
        if self._listen_sock is not None:
            self._server = await asyncio.start_server(self._accept, sock=self._listen_sock)
        else:
            host, port = self._listen  # type: ignore[misc]
            self._server = await asyncio.start_server(self._accept, host, port, reuse_address=True)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=5.0)

    async def __aenter__(self) -> DelayRelay:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._make_socket is None:
            return await asyncio.wait_for(
                asyncio.open_connection(*self.target), timeout=self._connect_timeout_s
            )
        sock = await self._make_socket()
        try:
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.sock_connect(sock, self.target), self._connect_timeout_s)
            return await asyncio.open_connection(sock=sock)
        except BaseException:
            sock.close()
            raise

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream_w: asyncio.StreamWriter | None = None
        failed = True
        try:
            try:
                upstream_r, upstream_w = await self._connect()
            except (OSError, asyncio.TimeoutError) as exc:
                log.warning("wan_relay_connect_failed", target=self.target, error=repr(exc))
                return
            for w in (client_w, upstream_w):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pumps = [
                asyncio.ensure_future(self._pump(client_r, upstream_w)),
                asyncio.ensure_future(self._pump(upstream_r, client_w)),
            ]
            try:
                # Either direction failing ends the connection; clean EOFs let the other finish.
                done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                failed = False
            finally:
                for task in pumps:
                    task.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass  # a peer reset the connection; the other side is aborted below
        finally:
            for w in (client_w, upstream_w):
                if w is None:
                    continue
                if failed:
                    w.transport.abort()  # propagate the reset instead of a clean EOF
                else:
                    w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Copy src to dst, each chunk released at its arrival time + delay, in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=self._max_chunks)

        async def receive() -> None:
            while True:
                data = await src.read(self._chunk_bytes)
                await queue.put((loop.time() + self.delay_s, data))
                if not data:
                    return

        window = SlowStartWindow(2 * self.delay_s, loss=self.loss) if self.slow_start else None

        async def send() -> None:
            while True:
                release_at, data = await queue.get()
                wait = release_at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if dst.can_write_eof() and not dst.is_closing():
                        dst.write_eof()
                    return
                view = memoryview(data)
                while view:
                    n = len(view)
                    if window is not None:
                        at, n = window.grant(loop.time(), n)
                        if at > loop.time():
                            # None may leave yet, or these arrive late (a lost segment resent):
                            # TCP hands bytes over in order, so everything after waits too.
                            await asyncio.sleep(at - loop.time())
                        if n == 0:
                            continue
                    dst.write(view[:n])
                    view = view[n:]
                await dst.drain()
                self.bytes_forwarded += len(data)

        tasks = {asyncio.ensure_future(receive()), asyncio.ensure_future(send())}
        try:
            # A clean EOF lets the sender drain the queue; a failure on either side ends both.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
