"""The RPC guard's server streams when the client leaves mid-stream (``weftboard.board.rpc_guard``).

A real gRPC server and client on loopback, no board behind them: what is under test is how the
guard ends a stream whose write gRPC refuses because the call is over. gRPC raises its
``InternalError`` from that write while ``context.cancelled()`` still says False, so the case is
built exactly: the handler writes once, waits, is cancelled by the client's leaving, and writes
again.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from weftboard.board.auth import Authenticator
from weftboard.board.metrics import BoardMetrics
from weftboard.board.rpc_guard import RpcGuard as _Guard


def _count(metrics: BoardMetrics, method: str, code: str) -> float:
    value = metrics.registry.get_sample_value("weftboard_rpcs_total", {"method": method, "code": code})
    return value or 0.0


async def test_a_stream_whose_client_left_ends_cancelled_not_as_an_internal_error() -> None:
    metrics = BoardMetrics()
    guard = _Guard(Authenticator(None, enabled=False), metrics, "redis://127.0.0.1:1/0")  # type: ignore[arg-type]
    late_write = asyncio.Event()

    async def probe(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.write(b"first")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # stands for a handler that reaches its next write after the client left
        late_write.set()
        await context.write(b"late")

    handler = grpc.unary_stream_rpc_method_handler(guard.stream("Probe", probe), request_deserializer=lambda b: b,
                                                   response_serializer=lambda b: b)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Probe", {"Probe": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with structlog.testing.capture_logs() as logs:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_stream("/test.Probe/Probe", request_serializer=lambda b: b,
                                            response_deserializer=lambda b: b)(b"")
                assert await call.read() == b"first"
                call.cancel()
            await asyncio.wait_for(late_write.wait(), 10)
            for _ in range(100):
                if _count(metrics, "Probe", "CANCELLED") or _count(metrics, "Probe", "INTERNAL"):
                    break
                await asyncio.sleep(0.05)
    finally:
        await server.stop(0)
    assert _count(metrics, "Probe", "CANCELLED") == 1
    assert _count(metrics, "Probe", "INTERNAL") == 0
    events = [entry["event"] for entry in logs]
    assert "stream ended: the peer went away" in events
    assert "unexpected error" not in events
