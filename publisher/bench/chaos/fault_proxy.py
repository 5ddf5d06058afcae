"""A TCP proxy whose link can be made to fail at run time: the chaos bench's network.

Every accepted connection is forwarded to one target (which ``retarget`` may change for new
connections: a server restarted on another port; ``None`` while it is down, so nothing reaches
whatever else takes its old port meanwhile: such connections are reset, as refused ones are). ``set_fault`` switches the whole link, its
live connections included, between:

- ``pass``: bytes forwarded as they come;
- ``latency``: each chunk released ``delay_s`` after it arrived, each way;
- ``bandwidth``: both directions paced to ``rate_bytes_s`` each, shared by every connection;
- ``reset``: every live connection is reset (RST both ways) and new ones are reset at once;
- ``blackhole``: nothing moves and nothing fails: the proxy stops reading and writing, new
  connections are accepted but not connected on; at heal everything held moves on (as TCP
  retransmission would deliver it);
- ``half_open``: the server side of every connection is gone (its socket reset) while the
  client's stays open, swallowing what the client sends and never answering; new connections
  are the same; at heal the client side is reset, as a rebooted peer answers.

Invariants:
- Bytes that are forwarded are forwarded intact and in order (one queue and one writer per
  direction); a fault never alters or reorders bytes, it delays, holds or cuts.
- A reset on one side is a reset on the other, at once: a client waiting for an answer from a
  server that died is told, as it would be without the proxy.
- Memory is bounded: each direction of a connection holds at most ``max_chunks`` chunks; a full
  queue stops reading (TCP backpressure).
- ``close`` stops listening and ends every connection, so the proxy never outlives its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass
from enum import Enum

CHUNK_BYTES = 64 * 1024


class FaultMode(str, Enum):
    PASS = "pass"
    LATENCY = "latency"
    BANDWIDTH = "bandwidth"
    RESET = "reset"
    BLACKHOLE = "blackhole"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class Fault:
    """What the link does now: a mode and its parameter (``delay_s`` or ``rate_bytes_s``)."""

    mode: FaultMode = FaultMode.PASS
    delay_s: float = 0.0
    rate_bytes_s: float = 0.0


def abort_with_reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a TCP RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Pacer:
    """A bandwidth cap for one direction of a link: each chunk waits for its slot."""

    def __init__(self) -> None:
        self.next_free = 0.0

    async def take(self, nbytes: int, rate_bytes_s: float) -> None:
        loop = asyncio.get_running_loop()
        start = max(loop.time(), self.next_free)
        self.next_free = start + nbytes / rate_bytes_s
        wait = self.next_free - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)


class _Connection:
    """One client connection and, once connected, its upstream."""

    def __init__(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.client_r = client_r
        self.client_w = client_w
        self.upstream_w: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task] = []
        self.half_open = False
        self.ended = asyncio.Event()

    def reset(self) -> None:
        """RST both sides and stop forwarding."""
        for task in self.tasks:
            task.cancel()
        for writer in (self.client_w, self.upstream_w):
            if writer is not None and not writer.transport.is_closing():
                abort_with_reset(writer)
        self.ended.set()

    def cut_server_side(self) -> None:
        """Half-open: the server's side vanishes; the client's stays open and is swallowed."""
        if self.half_open or self.ended.is_set():
            return
        self.half_open = True
        for task in self.tasks:
            task.cancel()
        if self.upstream_w is not None and not self.upstream_w.transport.is_closing():
            abort_with_reset(self.upstream_w)
        self.tasks = [asyncio.ensure_future(self._swallow())]

    async def _swallow(self) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while await self.client_r.read(CHUNK_BYTES):
                pass
        self.client_w.transport.abort()  # the client closed its side: nothing is left of it
        self.ended.set()


class FaultProxy:
    """Forward connections from ``host:port`` (0: a free port) to ``target``; ``set_fault`` at will."""

    def __init__(self, name: str, target: tuple[str, int] | None, *, host: str = "127.0.0.1", port: int = 0,
                 max_chunks: int = 64, connect_timeout_s: float = 5.0) -> None:
        self.name = name
        self.target = target
        self.fault = Fault()
        self._host = host
        self._port = port
        self._max_chunks = max_chunks
        self._connect_timeout_s = connect_timeout_s
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._serving: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self._pacers = (_Pacer(), _Pacer())  # client -> server, server -> client
        self.accepted = 0
        self.resets = 0
        self.bytes_forwarded = 0

    # -- life cycle ---------------------------------------------------------------

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, self._host, self._port, reuse_address=True)
        return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError(f"proxy {self.name} not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        """``host:port`` that clients dial."""
        return f"{self._host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.reset()
        await asyncio.gather(*self._serving, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)

    # -- control --------------------------------------------------------------------

    def retarget(self, target: tuple[str, int] | None) -> None:
        """New connections go to ``target`` (live ones keep theirs); ``None``: they are reset."""
        self.target = target

    def set_fault(self, fault: Fault) -> None:
        """Switch the link now; live connections follow (see the module docstring)."""
        previous = self.fault.mode
        self.fault = fault
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # wake everything held by a black hole or a delay to look again
        if fault.mode == FaultMode.RESET:
            self.reset_all()
        elif fault.mode == FaultMode.HALF_OPEN:
            for conn in list(self._connections):
                conn.cut_server_side()
        if previous == FaultMode.HALF_OPEN and fault.mode != FaultMode.HALF_OPEN:
            for conn in list(self._connections):
                if conn.half_open:
                    self.resets += 1
                    conn.reset()

    def heal(self) -> None:
        self.set_fault(Fault())

    def reset_all(self) -> None:
        for conn in list(self._connections):
            self.resets += 1
            conn.reset()

    # -- forwarding -----------------------------------------------------------------

    async def _hold_while_blackholed(self) -> None:
        while self.fault.mode == FaultMode.BLACKHOLE:
            await self._changed.wait()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        conn = _Connection(reader, writer)
        self._connections.add(conn)
        task = asyncio.ensure_future(self._serve(conn))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: _Connection) -> None:
        try:
            await self._hold_while_blackholed()
            if conn.ended.is_set() or conn.half_open:  # reset, or cut, while it was held
                await conn.ended.wait()
                return
            mode = self.fault.mode
            if mode == FaultMode.RESET:
                self.resets += 1
                conn.reset()
                return
            if mode == FaultMode.HALF_OPEN:
                conn.cut_server_side()
                await conn.ended.wait()
                return
            target = self.target
            try:
                if target is None:
                    raise ConnectionRefusedError(f"{self.name}: its server is down")
                upstream_r, upstream_w = await asyncio.wait_for(asyncio.open_connection(*target),
                                                                self._connect_timeout_s)
            except (OSError, asyncio.TimeoutError):
                conn.reset()  # as a refused connection looks to the client
                return
            conn.upstream_w = upstream_w
            for w in (conn.client_w, upstream_w):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.fault.mode in (FaultMode.RESET, FaultMode.HALF_OPEN):  # switched while connecting
                conn.reset() if self.fault.mode == FaultMode.RESET else conn.cut_server_side()
                await conn.ended.wait()
                return
            pumps = [asyncio.ensure_future(self._pump(conn.client_r, upstream_w, 0)),
                     asyncio.ensure_future(self._pump(upstream_r, conn.client_w, 1))]
            conn.tasks = pumps
            # a clean EOF one way lets the other way go on (a half-close); a failure either way
            # (a peer reset, a pump cut) ends both at once: the peer waiting for an answer must learn
            pending, failed = set(pumps), False
            while pending and not failed:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed = any(task.cancelled() or task.exception() is not None for task in done)
            if conn.half_open:  # the pumps were cut: the swallowing task carries the client now
                await conn.ended.wait()
                return
            if failed:
                conn.reset()  # one side failed: the other learns by a reset, not a clean EOF
            else:
                for w in (conn.client_w, upstream_w):
                    w.close()
                conn.ended.set()
        except asyncio.CancelledError:
            if not conn.half_open:
                conn.reset()
            raise
        finally:
            self._connections.discard(conn)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: int) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(self._max_chunks)

        async def receive() -> None:
            while True:
                await self._hold_while_blackholed()
                data = await src.read(CHUNK_BYTES)
                await queue.put((loop.time(), data))
                if not data:
                    return

        async def send() -> None:
            while True:
                arrived, data = await queue.get()
                while True:  # the fault may change while a chunk waits: look again on every change
                    await self._hold_while_blackholed()
                    fault = self.fault
                    wait = arrived + fault.delay_s - loop.time() if fault.mode == FaultMode.LATENCY else 0.0
                    if wait <= 0:
                        break
                    changed = self._changed
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(changed.wait(), wait)
                if not data:
                    if dst.can_write_eof() and not dst.is_closing():
                        dst.write_eof()
                    return
                fault = self.fault
                if fault.mode == FaultMode.BANDWIDTH and fault.rate_bytes_s > 0:
                    await self._pacers[direction].take(len(data), fault.rate_bytes_s)
                dst.write(data)
                await dst.drain()
                self.bytes_forwarded += len(data)

        tasks = [asyncio.ensure_future(receive()), asyncio.ensure_future(send())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            await asyncio.gather(*tasks)  # a clean EOF: the sender drains the queue first
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
