"""The ONE place where board RPCs meet auth, error mapping, metrics and log context.

``guarded(servicer)`` wraps every method of ``weftboard.v1.Board`` so that:
- the caller's token is checked against ``auth.METHOD_ROLES`` before the method runs;
- run, method and peer are bound to structlog's context for the request (the servicer
  binds the version where it has one);
- a ``weftboard.proto.errors`` exception becomes its status code with its message, a
  Redis connection failure becomes UNAVAILABLE, anything else INTERNAL (logged with its
  traceback, never silently);
- every call is counted by method and final status code, with its latency.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Callable

import grpc
import structlog

from weftboard.board.auth import Authenticator
from weftboard.board.metrics import BoardMetrics
from weftboard.board.store import REDIS_ERRORS
from weftboard.proto.errors import WeftboardError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.proto.v1 import board_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

STREAMING = frozenset({"Watch"})


def request_run(request: Any) -> str | None:
    """The run a request is about, for the log context."""
    for path in (("run",), ("run", "run"), ("record", "run"), ("status", "run")):
        obj = request
        try:
            for attr in path:
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        if isinstance(obj, str) and obj:
            return obj
    records = getattr(request, "records", None)
    if records:
        return records[0].run
    return None


def status_of(method: str, exc: BaseException, redis_url: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, WeftboardError):
        return getattr(grpc.StatusCode, exc.grpc_code_name, grpc.StatusCode.INTERNAL), str(exc)
    if isinstance(exc, REDIS_ERRORS):
        return grpc.StatusCode.UNAVAILABLE, f"Redis at {redis_url} is unreachable ({exc}); retry"
    log.error("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"


class _Guard:
    def __init__(self, auth: Authenticator, metrics: BoardMetrics, redis_url: str) -> None:
        self.auth = auth
        self.metrics = metrics
        self.redis_url = redis_url

    async def enter(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        structlog.contextvars.bind_contextvars(method=method, peer=context.peer(), run=request_run(request))
        await self.auth.authorize(method, context.invocation_metadata())

    def done(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.metrics.rpcs.labels(method, code.name).inc()
        self.metrics.latency.labels(method).observe(time.perf_counter() - started)

    def unary(self, method: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def handler(request, context):
            started = time.perf_counter()
            code, message = grpc.StatusCode.OK, ""
            with structlog.contextvars.bound_contextvars():
                try:
                    await self.enter(method, request, context)
                    return await fn(request, context)
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status below
                    code, message = status_of(method, exc, self.redis_url)
                finally:
                    self.done(method, code, started)
                log.info("rpc refused", code=code.name, detail=message)
            await context.abort(code, message)

        return handler

    def stream(self, method: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def handler(request, context):
            started = time.perf_counter()
            code, message = grpc.StatusCode.OK, ""
            with structlog.contextvars.bound_contextvars():
                try:
                    await self.enter(method, request, context)
                    async for item in fn(request, context):
                        yield item
                except (asyncio.CancelledError, GeneratorExit):
                    code = grpc.StatusCode.CANCELLED
                    raise
                except Exception as exc:  # noqa: BLE001
                    code, message = status_of(method, exc, self.redis_url)
                finally:
                    self.done(method, code, started)
                if code != grpc.StatusCode.OK:
                    log.info("rpc refused", code=code.name, detail=message)
            if code != grpc.StatusCode.OK:
                await context.abort(code, message)

        return handler


def guarded(servicer: Any, auth: Authenticator, metrics: BoardMetrics, redis_url: str) -> pb_grpc.BoardServicer:
    """A servicer whose every method passes through the guard above."""
    guard = _Guard(auth, metrics, redis_url)
    wrapped = pb_grpc.BoardServicer()
    for name in pb.DESCRIPTOR.services_by_name["Board"].methods_by_name:
        wrap = guard.stream if name in STREAMING else guard.unary
        setattr(wrapped, name, wrap(name, getattr(servicer, name)))
    return wrapped
