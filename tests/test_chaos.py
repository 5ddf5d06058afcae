"""The chaos bench: its fault proxy (each mode against a local echo server), its history checker
(synthetic histories with known violations), and one short seeded run of the whole system."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from weftboard.publisher.bench.chaos.bench import ChaosParams, run_chaos
from weftboard.publisher.bench.chaos.fault_proxy import (
    Fault,
    FaultMode,
    FaultProxy,
    abort_with_reset,
)
from weftboard.publisher.bench.chaos.history import (
    Ack,
    Audit,
    Delivery,
    History,
    Recovery,
    Response,
    check,
    failure_report,
)
from weftboard.publisher.bench.chaos.schedule import (
    FaultKind,
    ScheduledFault,
    make_schedule,
)

# -- the fault proxy -----------------------------------------------------------------


class EchoServer:
    """Echoes every byte back (``upper``: upper-cased, to tell two servers apart); counts
    connections and knows when the proxy's side of one went away."""

    def __init__(self, upper: bool = False) -> None:
        self.upper = upper
        self.connections = 0
        self.ended = 0
        self.ended_event = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> EchoServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    @property
    def target(self) -> tuple[str, int]:
        assert self.server is not None
        return "127.0.0.1", self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while data := await reader.read(65536):
                writer.write(data.upper() if self.upper else data)
                await writer.drain()
        except OSError:
            pass
        finally:
            self.ended += 1
            self.ended_event.set()
            writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


async def roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes,
                    timeout_s: float = 10.0) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), timeout_s)


@pytest.fixture
async def echo():
    server = await EchoServer().start()
    yield server
    await server.close()


@pytest.fixture
async def proxy(echo):
    p = await FaultProxy("test", echo.target).start()
    yield p
    await p.close()


async def connect(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = proxy.address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def test_pass_forwards_bytes_intact_both_ways(proxy):
    reader, writer = await connect(proxy)
    payload = os.urandom(300_000)
    assert await roundtrip(reader, writer, payload) == payload
    writer.close()


async def test_latency_delays_each_way_and_heals(proxy):
    reader, writer = await connect(proxy)
    assert await roundtrip(reader, writer, b"warm") == b"warm"
    proxy.set_fault(Fault(FaultMode.LATENCY, delay_s=0.15))
    t = time.monotonic()
    assert await roundtrip(reader, writer, b"slow") == b"slow"
    assert time.monotonic() - t >= 0.29  # 0.15 s out and 0.15 s back
    proxy.heal()
    t = time.monotonic()
    assert await roundtrip(reader, writer, b"fast") == b"fast"
    assert time.monotonic() - t < 0.15
    writer.close()


async def test_bandwidth_cap_paces_a_transfer(proxy):
    reader, writer = await connect(proxy)
    proxy.set_fault(Fault(FaultMode.BANDWIDTH, rate_bytes_s=256 * 1024))
    payload = os.urandom(192 * 1024)
    t = time.monotonic()
    assert await roundtrip(reader, writer, payload) == payload
    assert time.monotonic() - t >= 0.6  # 192 KiB at 256 KiB/s is 0.75 s each way, pipelined
    writer.close()


async def test_reset_resets_live_and_new_connections_until_healed(proxy):
    reader, writer = await connect(proxy)
    assert await roundtrip(reader, writer, b"a") == b"a"
    proxy.set_fault(Fault(FaultMode.RESET))
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(1), 5)
    reader2, writer2 = await connect(proxy)  # accepted, then reset
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        await roundtrip(reader2, writer2, b"b")
    proxy.heal()
    reader3, writer3 = await connect(proxy)
    assert await roundtrip(reader3, writer3, b"c") == b"c"
    writer3.close()


async def test_blackhole_holds_everything_without_error_and_delivers_at_heal(proxy, echo):
    reader, writer = await connect(proxy)
    assert await roundtrip(reader, writer, b"before") == b"before"
    proxy.set_fault(Fault(FaultMode.BLACKHOLE))
    writer.write(b"held")
    await writer.drain()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.readexactly(4), 0.4)
    reader2, writer2 = await connect(proxy)  # a new connection is accepted but goes nowhere
    writer2.write(b"new!")
    await writer2.drain()
    await asyncio.sleep(0.2)
    assert echo.connections == 1
    proxy.heal()
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"held"
    assert await asyncio.wait_for(reader2.readexactly(4), 5) == b"new!"
    assert echo.connections == 2
    writer.close()
    writer2.close()


async def test_half_open_cuts_the_server_side_and_resets_the_client_at_heal(proxy, echo):
    reader, writer = await connect(proxy)
    assert await roundtrip(reader, writer, b"hi") == b"hi"
    proxy.set_fault(Fault(FaultMode.HALF_OPEN))
    await asyncio.wait_for(echo.ended_event.wait(), 5)  # the server saw its connection go
    writer.write(b"anyone?")
    await writer.drain()  # the client's side still takes bytes, and nothing answers
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.read(1), 0.4)
    proxy.heal()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(1), 5)


async def test_a_server_that_resets_is_a_reset_for_the_client_at_once():
    """A server killed mid-request resets its connection: the client waiting for the answer must
    learn at once (not wait for its own read timeout while the proxy waits for it)."""
    async def reset_on_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        abort_with_reset(writer)

    server = await asyncio.start_server(reset_on_request, "127.0.0.1", 0)
    p = await FaultProxy("dies", ("127.0.0.1", server.sockets[0].getsockname()[1])).start()
    try:
        reader, writer = await connect(p)
        writer.write(b"request")
        await writer.drain()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1), 5)
    finally:
        await p.close()
        server.close()


async def test_a_detached_proxy_refuses_until_retargeted(proxy, echo):
    proxy.retarget(None)  # the server is down: its old port may belong to another process by now
    reader, writer = await connect(proxy)
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        await roundtrip(reader, writer, b"x")
    proxy.retarget(echo.target)
    reader, writer = await connect(proxy)
    assert await roundtrip(reader, writer, b"back") == b"back"
    writer.close()


async def test_retarget_sends_new_connections_to_the_new_server(proxy):
    other = await EchoServer(upper=True).start()
    try:
        reader, writer = await connect(proxy)
        assert await roundtrip(reader, writer, b"abc") == b"abc"
        proxy.retarget(other.target)
        reader2, writer2 = await connect(proxy)
        assert await roundtrip(reader2, writer2, b"abc") == b"ABC"
        assert await roundtrip(reader, writer, b"old") == b"old"  # the live one keeps its server
        writer.close()
        writer2.close()
    finally:
        await other.close()


# -- the schedule --------------------------------------------------------------------

LINKS = ["island-0>board-0", "island-0>board-1", "island-0>s3", "publisher>s3", "board-0>redis", "consumer>board-1"]


def schedule(seed: int, duration_s: float) -> list[ScheduledFault]:
    return make_schedule(seed, duration_s, kinds=list(FaultKind), islands=["island-0", "island-1"], replicas=2,
                         links=LINKS)


def test_schedule_is_seeded_scales_with_duration_and_covers_every_kind():
    short = schedule(5, 60)
    assert short == schedule(5, 60) and short != schedule(6, 60)  # a seed replays its schedule
    assert {f.kind for f in short} == set(FaultKind)  # a short run still injects every kind
    long = schedule(5, 300)
    assert len(long) >= 30 and len({f.kind for f in long}) == len(FaultKind)
    assert [f.at_s for f in long] == sorted(f.at_s for f in long)
    assert all(2.0 <= f.at_s <= 0.9 * 300 and f.hold_s > 0 for f in long)
    for f in long:
        if f.kind in (FaultKind.NET_LATENCY, FaultKind.NET_RESET):
            client, server = f.target.split(">")
            assert f.target in LINKS or (server == "board-*" and any(link.startswith(f"{client}>board-")
                                                                     for link in LINKS))


# -- the history checker ---------------------------------------------------------------


def clean_history() -> History:
    """Three versions, two islands that end on the head, answers inside their constraints, each
    reported trajectory delivered (one of them twice: a redelivery, which deduplication removes)."""
    h = History(seed=7)
    for v in (1, 2, 3):
        h.acks += [Ack(float(v), v, f"r{v}", "publisher"), Ack(v + 0.1, v, f"r{v}", "observer")]
    h.final_versions, h.final_head = {1: "r1", 2: "r2", 3: "r3"}, 3
    h.responses = [Response(1.5, "island-0", "a", "min", 1, 200, 1, 1, "p0", "c1"),
                   Response(2.5, "island-1", "b", "exact", 2, 200, 2, 2, "p0", "c2"),
                   Response(2.6, "island-0", "c", "exact", 3, 409)]
    h.audits = [Audit(2.0, "island-0", 2, "r2", "r2", "periodic")]
    h.reported = {"a": 1.6, "b": 2.6}
    h.deliveries = [Delivery(1.7, "a", "x"), Delivery(2.7, "b", "y"), Delivery(5.0, "a", "x")]
    h.final_islands = {"island-0": 3, "island-1": 3}
    h.recoveries = [Recovery(2.0, "island", "island_kill on island-0", 5.0)]
    h.event(2.9, "fault", "#3 net_blackhole on consumer>board-*")
    return h


BOUNDS = {"island": 60.0, "board": 60.0}


def test_checker_passes_a_clean_history():
    verdict = check(clean_history(), BOUNDS)
    assert verdict.ok, verdict.violations
    assert verdict.versions_committed == 3 and verdict.trajectories_redelivered == 1
    assert verdict.trajectories_duplicated == 0 and verdict.trajectories_lost == 0


def test_checker_flags_a_wrong_version_answer_and_a_lost_trajectory():
    h = clean_history()
    h.responses.append(Response(3.0, "island-1", "d", "min", 3, 200, 2, 3, "p1", "c3"))  # started on 2 under min=3
    h.reported["d"] = 3.1  # the board acknowledged d's record; the consumer never got it
    verdict = check(h, BOUNDS)
    assert not verdict.ok
    assert verdict.wrong_version_responses == 1 and verdict.trajectories_lost == 1
    assert {v.check for v in verdict.violations} == {"wrong_version_responses", "trajectories_lost"}
    lines = failure_report(h, verdict)
    assert "seed 7" in lines[0] and "--seed 7" in lines[0]
    assert any("net_blackhole on consumer" in line for line in lines)  # the events around each violation


def test_checker_flags_lost_and_conflicting_versions_torn_checkpoints_and_slow_recoveries():
    h = clean_history()
    h.acks.append(Ack(4.0, 4, "r4", "publisher"))  # acknowledged to the publisher, absent from the history
    h.acks.append(Ack(4.5, 2, "other", "observer"))  # version 2 seen with other contents
    h.audits.append(Audit(5.0, "island-1", 3, "bad", "r3", "after_kill"))  # a torn checkpoint on disk
    h.responses.append(Response(5.5, "island-1", "e", "min", 1, 200, 1, 1, "p0", "c9"))  # v1 answers p0 otherwise
    h.responses.append(Response(5.6, "island-0", "f", "exact", 9, 200, 9, 9, "p2", "c0"))  # a version never committed
    h.deliveries.append(Delivery(6.0, "b", "z"))  # request b delivered again with another record
    h.recoveries.append(Recovery(6.0, "board", "board_kill on board-0", None))
    h.recoveries.append(Recovery(6.5, "island", "disk_full on island-1", 61.0))
    h.final_islands["island-2"] = 2
    verdict = check(h, BOUNDS)
    assert verdict.counts() | {"trajectories_redelivered": 0, "trajectories_unreported": 0} == {
        "versions_committed": 3, "versions_lost": 1, "conflicting_versions": 1, "torn_activations": 2,
        "wrong_version_responses": 1, "trajectories_lost": 0, "trajectories_duplicated": 1,
        "trajectories_redelivered": 0, "trajectories_unreported": 0, "islands_behind": 1, "recovery_exceeded": 2}
    assert [v.t for v in verdict.violations] == sorted(v.t for v in verdict.violations)


# -- one short run of the whole system ---------------------------------------------------

ZERO_KEYS = ("versions_lost", "conflicting_versions", "torn_activations", "wrong_version_responses",
             "trajectories_lost", "trajectories_duplicated", "islands_behind", "recovery_exceeded")


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_short_seeded_chaos_run_injects_every_kind_and_loses_nothing(tmp_path):
    """Real Redis (AOF), SeaweedFS, two boards, a trainer, three islands, requests and a consumer,
    with one fault of every kind in 60 s: the history must hold every check."""
    lines: list[str] = []
    result, failed = await run_chaos(ChaosParams(duration_s=60, seed=11, work_dir=tmp_path / "chaos"), lines.append)
    assert not failed, "\n".join(lines + failed)
    assert result["ok"] and result["seed"] == 11
    assert result["faults_injected"] >= 11 and len(result["fault_kinds"]) >= 8, result["fault_kinds"]
    assert {k: result[k] for k in ZERO_KEYS} == dict.fromkeys(ZERO_KEYS, 0), result
    assert result["versions_committed"] >= 20 and result["requests_ok"] >= 20, result
    assert result["trajectories_delivered"] == result["trajectories_reported"] > 0
    assert all(v is not None for v in result["max_recovery_s"].values()), result["max_recovery_s"]
    assert result["audits"] > 0 and set(result["rss_growth_mb"]) >= {"redis", "s3", "board-0", "island-0"}
