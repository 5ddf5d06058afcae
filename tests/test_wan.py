"""The WAN simulation: the delaying relay, namespaces behind tbf links, and their cleanup.

Relay tests run anywhere (loopback only). Namespace tests need root and iproute2; they are skipped
with the reason ``check_capability`` gives where the machine does not allow them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from weftboard.publisher.bench.wan import (
    DelayRelay,
    WanTopology,
    WanUnavailable,
    check_capability,
    netns,
)
from weftboard.publisher.bench.wan.bench import WAN_LOSS
from weftboard.publisher.bench.wan.window import BETA, SEGMENT_BYTES, SlowStartWindow


def _wan_skip_reason() -> str | None:
    try:
        check_capability()
    except WanUnavailable as exc:
        return str(exc)
    return None


_SKIP = _wan_skip_reason()
needs_netns = pytest.mark.skipif(_SKIP is not None, reason=f"WAN simulation unavailable: {_SKIP}")


async def _echo_server() -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _rtt(host: str, port: int, samples: int = 5) -> float:
    """Smallest round trip of one byte on one connection (the smallest is the least noisy)."""
    reader, writer = await asyncio.open_connection(host, port)
    best = float("inf")
    for _ in range(samples):
        start = time.perf_counter()
        writer.write(b"x")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(1), 5) == b"x"
        best = min(best, time.perf_counter() - start)
    writer.close()
    return best


# ---- the relay (loopback only, runs everywhere) --------------------------------------------------


async def test_relay_adds_the_configured_delay_each_way() -> None:
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    delay = 0.03
    async with server, DelayRelay(("127.0.0.1", port), delay, listen=("127.0.0.1", 0)) as relay:
        direct = await _rtt("127.0.0.1", port)
        relayed = await _rtt(*relay.address)
    # Both directions are delayed, so a round trip takes at least twice the one-way delay.
    assert relayed >= 2 * delay
    assert relayed > direct + 2 * delay * 0.95


async def test_relay_passes_bytes_intact_in_order_and_propagates_half_close() -> None:
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    payload = os.urandom(3 * 1024 * 1024 + 17)
    async with server, DelayRelay(("127.0.0.1", port), 0.005, listen=("127.0.0.1", 0)) as relay:
        reader, writer = await asyncio.open_connection(*relay.address)

        async def send() -> None:
            writer.write(payload)
            await writer.drain()
            writer.write_eof()  # must reach the echo server, which then closes its side

        sender = asyncio.create_task(send())
        echoed = await asyncio.wait_for(reader.read(-1), 20)  # returns only at the echoed EOF
        await sender
        writer.close()
    assert echoed == payload


async def test_relay_pipelines_chunks_instead_of_one_per_delay() -> None:
    """8 MiB is >= 128 reads of 64 KiB: one chunk per delay would take >= 6.4 s at 50 ms."""
    size, delay = 8 * 1024 * 1024, 0.05

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"\0" * size)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, DelayRelay(("127.0.0.1", port), delay, listen=("127.0.0.1", 0)) as relay:
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection(*relay.address)
        received = len(await asyncio.wait_for(reader.read(-1), 30))
        elapsed = time.perf_counter() - start
        writer.close()
    assert received == size
    assert elapsed >= delay
    assert elapsed < 0.3 * (size / 65536) * delay, f"{elapsed:.2f}s looks serialised per chunk"


def test_slow_start_window_doubles_per_round_trip_and_restarts_after_idle() -> None:
    rtt, iw = 0.04, 14480
    w = SlowStartWindow(rtt, initial_bytes=iw)
    assert w.grant(0.0, 10**9) == (0.0, iw)  # the first round trip carries the initial window
    assert w.grant(0.01, 10**9) == (rtt, 0)  # used up: nothing until the next round trip
    assert w.grant(rtt, 10**9) == (rtt, 2 * iw)  # doubled, because the window was used up
    assert w.grant(2 * rtt, 10**9) == (2 * rtt, 4 * iw)
    # Application-limited rounds do not grow the window.
    assert w.grant(3 * rtt, 100) == (3 * rtt, 100)
    assert w.grant(4 * rtt, 10**9) == (4 * rtt, 8 * iw)
    # Idle for several RTOs: back to the initial window (halved once per RTO).
    idle_from = 4 * rtt
    assert w.grant(idle_from + 10 * w.rto_s, 10**9) == (idle_from + 10 * w.rto_s, iw)


def test_slow_start_window_total_after_k_round_trips_is_geometric() -> None:
    rtt, iw = 0.04, 14480
    w = SlowStartWindow(rtt, initial_bytes=iw)
    sent, now = 0, 0.0
    while now < 5 * rtt - 1e-9:
        at, n = w.grant(now, 10**9)
        sent += n
        now = at if n == 0 else now
    assert sent == iw * (2**5 - 1)


class _Draws:
    """A random source that returns the given draws in turn (0.0: lost, 1.0: delivered)."""

    def __init__(self, *draws: float) -> None:
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0)


def test_a_lost_segment_arrives_a_round_trip_late_and_cuts_the_window_once_per_round_trip() -> None:
    rtt, iw = 0.04, 14480
    w = SlowStartWindow(rtt, initial_bytes=iw, loss=0.01, rng=_Draws(1.0, 1.0, 0.0, 1.0, 0.0, 0.0))
    assert w.grant(0.0, 10**9) == (0.0, iw)
    assert w.grant(rtt, 10**9) == (rtt, 2 * iw)
    # Round 3: a segment of its 4 windows' bytes is lost: they arrive one round trip late and
    # the window (and the slow-start threshold) drop to BETA of it.
    assert w.grant(2 * rtt, 10**9) == (3 * rtt, 4 * iw)
    cut = int(4 * iw * BETA)
    assert (w.cwnd, w.ssthresh, w.losses) == (cut, cut, 1)
    assert w.grant(2 * rtt + 0.001, 10**9) == (3 * rtt, 0)  # more than the cut window left already
    # Past the threshold the window grows by one segment per used-up round trip.
    assert w.grant(3 * rtt, 10**9) == (3 * rtt, cut + SEGMENT_BYTES)
    # Two losses in one round trip (the window first grew one more segment, as the last round
    # trip used it up): both late, one cut (one recovery per window of data).
    assert w.grant(4 * rtt, 100) == (5 * rtt, 100)
    again = int((cut + 2 * SEGMENT_BYTES) * BETA)
    assert w.grant(4 * rtt + 0.001, 100) == (5 * rtt + 0.001, 100)
    assert (w.cwnd, w.losses) == (again, 3)


def test_a_restart_after_idle_keeps_three_quarters_of_the_window_as_its_threshold() -> None:
    rtt, iw = 0.04, 14480
    w = SlowStartWindow(rtt, initial_bytes=iw, loss=0.01, rng=_Draws(0.0, *[1.0] * 6))
    assert w.grant(0.0, 10**9) == (rtt, iw)  # lost at once: the threshold falls to 0.7 of it
    assert w.ssthresh == int(iw * BETA)
    for k in range(1, 5):  # congestion avoidance: one segment per used-up round trip
        assert w.grant(k * rtt, 10**9)[1] == int(iw * BETA) + k * SEGMENT_BYTES
    before = w.cwnd
    assert w.grant(5 * rtt + 10 * w.rto_s, 10**9)[1] == iw  # idle: back to the initial window
    assert w.ssthresh == before * 3 // 4 > int(iw * BETA)


def test_losses_follow_the_chance_per_segment() -> None:
    rng, trials = random.Random(7), 4000
    late = 0
    for _ in range(trials):
        at, n = SlowStartWindow(0.04, loss=0.01, rng=rng).grant(0.0, 10 * SEGMENT_BYTES)
        assert n == 10 * SEGMENT_BYTES
        late += at > 0.0
    expected = 1 - 0.99**10  # any of the 10 segments lost: 9.6%
    assert abs(late / trials - expected) < 0.015
    assert SlowStartWindow(0.04).grant(0.0, 10**6)[0] == 0.0  # no loss unless asked
    with pytest.raises(ValueError, match="chance"):
        SlowStartWindow(0.04, loss=1.0)


async def test_relay_with_loss_delivers_every_byte_in_order_and_later() -> None:
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    payload = os.urandom(600_000 + 5)
    elapsed = {}
    async with server:
        for loss in (0.0, 0.02):
            relay = DelayRelay(("127.0.0.1", port), 0.005, listen=("127.0.0.1", 0), slow_start=True, loss=loss)
            async with relay:
                reader, writer = await asyncio.open_connection(*relay.address)
                start = time.perf_counter()
                writer.write(payload)
                await writer.drain()
                writer.write_eof()
                echoed = await asyncio.wait_for(reader.read(-1), 30)
                elapsed[loss] = time.perf_counter() - start
                writer.close()
            assert echoed == payload
    # 2% a segment over ~830 segments each way: losses are certain, each a round trip late.
    assert elapsed[0.02] > elapsed[0.0] + 2 * 0.01


async def test_relay_slow_start_makes_a_fresh_transfer_ramp_over_round_trips() -> None:
    """1 MB after idle needs 7 rounds of a doubling 14480-byte window (6 full round trips);
    with the window off the same relay delivers it in about one one-way delay."""
    size, delay = 1_000_000, 0.02

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1):
            writer.write(b"\0" * size)
            await writer.drain()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    timings = {}
    async with server:
        for slow_start in (True, False):
            relay = DelayRelay(("127.0.0.1", port), delay, listen=("127.0.0.1", 0), slow_start=slow_start)
            async with relay:
                reader, writer = await asyncio.open_connection(*relay.address)
                for attempt in ("fresh", "warm"):
                    start = time.perf_counter()
                    writer.write(b"g")
                    await reader.readexactly(size)
                    timings[(slow_start, attempt)] = time.perf_counter() - start
                writer.close()
    assert timings[(True, "fresh")] >= 6 * 2 * delay
    assert timings[(False, "fresh")] < 3 * 2 * delay
    # Right after a transfer the window is open: the next one does not ramp again.
    assert timings[(True, "warm")] < timings[(True, "fresh")] / 2


async def test_relay_to_a_closed_port_ends_the_client_connection() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    dead_port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    async with DelayRelay(("127.0.0.1", dead_port), 0.0, listen=("127.0.0.1", 0)) as relay:
        reader, writer = await asyncio.open_connection(*relay.address)
        try:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        except ConnectionResetError:
            pass  # also an acceptable way to learn the target is gone
        writer.close()


async def test_relay_close_ends_live_connections() -> None:
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    async with server:
        relay = await DelayRelay(("127.0.0.1", port), 0.0, listen=("127.0.0.1", 0)).start()
        reader, writer = await asyncio.open_connection(*relay.address)
        writer.write(b"hi")
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"hi"
        await asyncio.wait_for(relay.close(), 5)
        try:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        except ConnectionResetError:
            pass
        writer.close()


def test_relay_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        DelayRelay(("127.0.0.1", 1), -1.0, listen=("127.0.0.1", 0))
    with pytest.raises(ValueError):
        DelayRelay(("127.0.0.1", 1), 0.0)
    with pytest.raises(ValueError, match="loopback"):
        WanTopology(1, [80], target_host="10.0.0.1")
    with pytest.raises(ValueError, match="needs slow_start"):
        DelayRelay(("127.0.0.1", 1), 0.01, listen=("127.0.0.1", 0), loss=0.01)
    with pytest.raises(ValueError, match="loss"):
        WanTopology(1, [80], slow_start=False, loss=0.01)


# ---- capability messages --------------------------------------------------------------------------


def test_missing_iproute2_is_reported_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the root check answers first when not running as root")
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no ip, no tc
    with pytest.raises(WanUnavailable, match="iproute2"):
        check_capability()


def test_non_root_is_reported_clearly() -> None:
    code = (
        "from weftboard.publisher.bench.wan import check_capability, WanUnavailable\n"
        "try:\n    check_capability()\nexcept WanUnavailable as e:\n    print('UNAVAILABLE', e)\n"
    )
    kwargs = {"user": 65534} if os.geteuid() == 0 else {}
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, **kwargs
        )
    except PermissionError:
        pytest.skip("cannot run this Python interpreter as user nobody here")
    if result.returncode != 0 and "Permission denied" in result.stderr:
        pytest.skip(f"user nobody cannot import the project here: {result.stderr[-200:]}")
    assert result.returncode == 0, result.stderr
    assert "UNAVAILABLE" in result.stdout and "root" in result.stdout


# ---- namespaces behind tbf links ------------------------------------------------------------------

_ISLAND_CLIENT = """
import json, socket, sys, time
host, port, upload = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port), timeout=10)
best = 1e9
for _ in range(3):
    t = time.perf_counter(); s.sendall(b"r"); assert s.recv(1) == b"r"; best = min(best, time.perf_counter() - t)
t = time.perf_counter(); s.sendall(b"d"); n = 0
while True:
    d = s.recv(1 << 16)
    if not d: break
    n += len(d)
down = time.perf_counter() - t
s = socket.create_connection((host, port), timeout=10)
s.sendall(b"u"); t = time.perf_counter(); s.sendall(b"\\0" * upload); s.shutdown(socket.SHUT_WR)
assert s.recv(2) == b"ok"
up = time.perf_counter() - t
print(json.dumps({"rtt_s": best, "down_bytes": n, "down_s": down, "up_bytes": upload, "up_s": up}))
"""


async def _traffic_server(download_bytes: int) -> asyncio.Server:
    """'r' echoes one byte; 'd' sends download_bytes and closes; 'u' reads to EOF, answers ok."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while cmd := await reader.read(1):
            if cmd == b"r":
                writer.write(b"r")
            elif cmd == b"d":
                writer.write(b"\0" * download_bytes)
                await writer.drain()
                break
            elif cmd == b"u":
                while await reader.read(1 << 16):
                    pass
                writer.write(b"ok")
                await writer.drain()
                break
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _run_in_island(wan: WanTopology, island: int, host: str, port: int, upload: int) -> dict:
    proc = await asyncio.create_subprocess_exec(
        *wan.prefix(island), sys.executable, "-c", _ISLAND_CLIENT, host, str(port), str(upload),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return json.loads(out.decode().strip().splitlines()[-1])


def _our_objects(pid: int) -> list[str]:
    ns = [n for n in netns.list_namespaces() if n.startswith(f"{netns.NS_PREFIX}{pid}-")]
    links = [
        n for n in netns.list_links()
        if n.startswith((f"{netns.HOST_IF_PREFIX}{pid}x", f"{netns.NS_IF_PREFIX}{pid}x"))
    ]
    return ns + links


@needs_netns
async def test_islands_are_rate_limited_and_delayed_both_ways() -> None:
    rate_mbit, rtt_ms, size = 20.0, 40.0, 2_500_000  # 1 s per direction at the limit
    server = await _traffic_server(size)
    port = server.sockets[0].getsockname()[1]
    async with server:
        async with WanTopology(2, [port], rate_mbit=rate_mbit, rtt_ms=rtt_ms) as wan:
            assert len(set(wan.namespace(i) for i in range(2))) == 2
            # Island 0 uses the unchanged loopback address; island 1 the relay's own address.
            results = await asyncio.gather(
                _run_in_island(wan, 0, "127.0.0.1", port, size),
                _run_in_island(wan, 1, *wan.address(1, port), size),
            )
            drops = await asyncio.to_thread(wan.queue_drops)  # read from both ends of both links
            assert isinstance(drops, int) and drops >= 0
        forwarded = wan.bytes_forwarded(0)
    limit_bytes_per_s = rate_mbit * 1e6 / 8
    for r in results:
        assert r["down_bytes"] == size
        assert r["rtt_s"] >= rtt_ms / 1000
        for direction in ("down", "up"):
            rate = size / r[f"{direction}_s"]
            # Below the limit (a small allowance for the token bucket's initial burst) ...
            assert rate <= limit_bytes_per_s * 1.05, (direction, rate, r)
            # ... and the link really carries traffic (not stalled, not a no-op).
            assert rate >= limit_bytes_per_s * 0.3, (direction, rate, r)
    assert forwarded >= 2 * size
    assert _our_objects(os.getpid()) == []


@needs_netns
def test_cleanup_after_an_error_and_keyboard_interrupt() -> None:
    for exc_type in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc_type), WanTopology(2, [1], rtt_ms=0) as wan:
            assert len(_our_objects(os.getpid())) == 4  # 2 namespaces + 2 host veths
            assert wan.namespace(0) in netns.list_namespaces()
            raise exc_type("boom")
        assert _our_objects(os.getpid()) == []


@needs_netns
def test_sigterm_removes_the_namespaces_and_the_relay_process() -> None:
    code = (
        "import time\n"
        "from weftboard.publisher.bench.wan import WanTopology\n"
        "with WanTopology(2, [1]):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        while (line := proc.stdout.readline()) and line.strip() != "up":
            pass
        assert line.strip() == "up"
        assert len(_our_objects(proc.pid)) == 4
        relay_processes = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert _our_objects(proc.pid) == []
    assert relay_processes and not any(_alive(pid) for pid in relay_processes)


def _children(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@needs_netns
def test_stale_objects_of_a_killed_run_are_removed_and_live_ones_kept() -> None:
    code = (
        "import sys, time\n"
        "from weftboard.publisher.bench.wan import WanTopology\n"
        "w = WanTopology(1, [1]).open()\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        while (line := proc.stdout.readline()) and line.strip() != "up":
            pass  # log lines
        assert line.strip() == "up"
        assert len(_our_objects(proc.pid)) == 2
        netns.remove_stale()
        assert len(_our_objects(proc.pid)) == 2  # its process is alive: never touched
        relay_processes = _children(proc.pid)
        assert relay_processes, "the topology runs its relays in a child process"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert len(_our_objects(proc.pid)) == 2  # SIGKILL: no chance to clean up
    # The relay process is tethered to its owner's stdin pipe and leaves with it.
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in relay_processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in relay_processes)
    removed = netns.remove_stale()
    assert f"{netns.NS_PREFIX}{proc.pid}-0" in removed
    assert _our_objects(proc.pid) == []


_ISLAND_S3_CLIENT = """
import asyncio, hashlib, json, sys, time
from weftboard.board.blobs import fetch_url
from weftboard.board.blobs.s3 import S3BlobStore
endpoint, access, secret, bucket, prefix, key, url, dest = sys.argv[1:9]
store = S3BlobStore(endpoint, access, secret, bucket, region="us-east-1", prefix=prefix)
t = time.perf_counter(); data = asyncio.run(store.get_bytes(key)); signed_s = time.perf_counter() - t
t = time.perf_counter(); asyncio.run(fetch_url(url, dest)); presigned_s = time.perf_counter() - t
print(json.dumps({
    "signed": hashlib.sha256(data).hexdigest(), "signed_s": signed_s,
    "presigned": hashlib.sha256(open(dest, "rb").read()).hexdigest(), "presigned_s": presigned_s,
}))
"""


@needs_netns
async def test_island_reads_real_s3_through_the_link_signed_and_presigned(
    s3_server, s3_store, tmp_path
) -> None:
    """Islands keep using 127.0.0.1:<s3 port>: signed requests and presigned URLs (whose Host
    is part of the signature) both work unchanged, and the bytes really cross the link."""
    import hashlib

    rate_mbit, size = 50.0, 1_500_000  # 0.24 s at the limit
    payload = os.urandom(size)
    await s3_store.put_bytes("wan/blob", payload)
    url = await s3_store.presign_get("wan/blob", 300)
    assert url and f"127.0.0.1:{s3_server.port}" in url
    async with WanTopology(1, [s3_server.port], rate_mbit=rate_mbit, rtt_ms=40) as wan:
        proc = await asyncio.create_subprocess_exec(
            *wan.prefix(0), sys.executable, "-c", _ISLAND_S3_CLIENT, s3_server.endpoint,
            s3_server.access_key, s3_server.secret_key, s3_server.bucket, s3_store.prefix,
            "wan/blob", url, str(tmp_path / "presigned.bin"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-2000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    expected = hashlib.sha256(payload).hexdigest()
    assert result["signed"] == expected and result["presigned"] == expected
    floor_s = size * 8 / (rate_mbit * 1e6)
    assert result["signed_s"] >= floor_s and result["presigned_s"] >= floor_s
    assert wan.bytes_forwarded(0) >= 2 * size


# ---- the bench hook --------------------------------------------------------------------------------


def test_tbf_drops_counts_only_the_rate_limits() -> None:
    shown = json.dumps([
        {"kind": "tbf", "handle": "81b2:", "root": True, "bytes": 1343564642, "packets": 888985, "drops": 31562},
        {"kind": "tbf", "handle": "81b3:", "drops": 7},
        {"kind": "noqueue", "handle": "0:", "drops": 5},
    ])
    assert netns.tbf_drops(shown) == 31569
    assert netns.tbf_drops("[]") == 0 and netns.tbf_drops("") == 0


def test_wan_network_only_relays_loopback_endpoints() -> None:
    from weftboard.publisher.bench.wan.bench import _loopback_port

    assert _loopback_port("127.0.0.1:9000") == 9000
    assert _loopback_port("http://localhost:8333/") == 8333
    for other in ("10.1.2.3:9000", "[::1]:50051"):
        with pytest.raises(ValueError, match="loopback"):
            _loopback_port(other)


def test_skipped_line_is_json_with_the_reason() -> None:
    from weftboard.publisher.bench.wan.bench import skipped_line

    line = json.loads(skipped_line(WanUnavailable("needs root (running as uid 1000)")))
    assert line == {"skipped": "--wan unavailable: needs root (running as uid 1000)"}


@needs_netns
async def test_wan_network_gives_islands_relay_endpoints_on_their_own_links() -> None:
    from weftboard.publisher.bench.wan.bench import WanNetwork

    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    net = WanNetwork(2, rate_mbit=100, rtt_ms=20)
    async with server:
        await net.start([f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"])
        try:
            relays = [net.board_address(i, f"127.0.0.1:{port}") for i in range(2)]
            assert net.s3_endpoint(0, f"http://127.0.0.1:{port}") == "http://" + relays[0]
            hosts = {r.rsplit(":", 1)[0] for r in relays}
            assert len(hosts) == 2 and all(h.startswith("10.203.") for h in hosts)
            assert list(net.prefix(1))[:3] == ["ip", "netns", "exec"]
            assert net.describe() == {
                "network": "wan", "wan": {"rate_mbit": 100, "rtt_ms": 20, "tcp_slow_start": True, "loss": WAN_LOSS}
            }
        finally:
            await net.close()
    assert _our_objects(os.getpid()) == []


# ---- weftboard bench sync --wan --------------------------------------------------------------------


def test_bench_sync_wan_skips_cleanly_where_unavailable(tmp_path) -> None:
    """No iproute2 on PATH (or not root): exit 0, a message, and a JSON line saying why."""
    env = {**os.environ, "PATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "weftboard.board.cli", "bench", "sync", "--wan", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(last) == {"skipped"} and "--wan unavailable" in last["skipped"]
    assert "skipping bench sync --wan" in result.stderr


@needs_netns
@pytest.mark.slow
def test_bench_sync_wan_small_model_end_to_end(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "weftboard.board.cli", "bench", "sync", "--wan", "--json",
         "--params", "2000000", "--islands", "1", "--versions", "1",
         "--wan-rate-mbit", "200", "--wan-rtt-ms", "10", "--wan-loss", "0.001", "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["network"] == "wan"
    assert out["wan"] == {"rate_mbit": 200.0, "rtt_ms": 10.0, "tcp_slow_start": True, "loss": 0.001}
    for key in ("params", "islands", "versions", "delta_bytes_per_version", "full_bytes_per_version",
                "delta_sync_p50_s", "delta_sync_p99_s", "full_sync_p50_s", "speedup_p50", "bytes_ratio",
                "trainer_blocked_s_per_version", "publisher_extra_memory_ratio"):
        assert key in out, key
    assert out["bitwise_ok"] is True
    assert set(out["wan_queue_drops"]) == {"delta_versions", "full_checkpoints"}
    assert all(isinstance(n, int) and n >= 0 for n in out["wan_queue_drops"].values())
    # Every island sat behind its link: a full checkpoint cannot arrive faster than the rate.
    assert out["full_sync_p50_s"] >= out["full_bytes_per_version"] * 8 / 200e6
    # The bench has exited: no namespace of a dead process may be left behind.
    left = [n for n in netns.list_namespaces() if n.startswith(netns.NS_PREFIX)]
    assert all(netns._pid_alive(int(n.split("-")[2])) for n in left), left
