"""The ONE place where board RPCs meet auth, error mapping, metrics and log context.

``add_board_to_server`` wraps every method of ``weftboard.v1.Board`` so that:
- the caller's token is checked against ``auth.METHOD_ROLES`` before the method runs;
- run, method and peer are bound to structlog's context for the request (the servicer
  binds the version where it has one);
- a ``weftboard.proto.errors`` exception becomes its status code with its message, a
  Redis connection failure, a write refused by a replica (a failover) or a command Redis
  refuses for now (out of memory, busy with a script, loading, its master down) becomes
  UNAVAILABLE, anything else INTERNAL (logged with its traceback, never silently);
- a server stream ends as UNAUTHENTICATED once its caller's token is revoked: at once when
  this board revokes it, else at its next re-check (every ``Authenticator.recheck_every_s``,
  through the cached lookup): a revoked island keeps no open Watch on any replica;
- a server stream whose peer has gone (a write refused by gRPC after the client cancelled
  or disconnected) ends as CANCELLED, logged at info: nobody is left to tell;
- every call is counted by method and final status code, with its latency.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import structlog
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import ResponseError as RedisResponseError

from weftboard.board.auth import Authenticator, bearer
from weftboard.board.metrics import BoardMetrics
from weftboard.board.store import REDIS_ERRORS
from weftboard.proto.errors import Unauthenticated, WeftboardError
from weftboard.proto.v1 import board_pb2 as pb

log = structlog.get_logger(__name__)

# Errors Redis answers while it cannot take a command it would take later, which redis-py
# leaves as a plain ResponseError (OOM and LOADING get classes of their own).
_REDIS_FOR_NOW = ("BUSY ", "MASTERDOWN ")


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
    if isinstance(exc, RedisReadOnlyError):  # a failover in progress, or the URL names a replica
        return grpc.StatusCode.UNAVAILABLE, f"Redis at {redis_url} refuses writes, being a replica ({exc}); retry"
    if isinstance(exc, RedisOutOfMemoryError) or (isinstance(exc, RedisResponseError)
                                                  and str(exc).startswith(_REDIS_FOR_NOW)):
        return grpc.StatusCode.UNAVAILABLE, f"Redis at {redis_url} refused the command for now ({exc}); retry"
    log.error("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"


class _PeerGone(Exception):
    """A server stream's write failed because its call is over: the client cancelled or its
    connection closed between two writes."""


class RpcGuard:
    """Wraps one servicer method: auth, log context, error-to-status mapping and metrics."""

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
                except _PeerGone as exc:
                    code = grpc.StatusCode.CANCELLED
                    log.info("stream ended: the peer went away", detail=str(exc))
                    return None
                except Exception as exc:  # noqa: BLE001 - mapped to a status below
                    code, message = status_of(method, exc, self.redis_url)
                finally:
                    self.done(method, code, started)
                log.info("rpc refused", code=code.name, detail=message)
            await context.abort(code, message)

        return handler

    def stream(self, method: str, fn: Callable) -> Callable:
        """Server streaming: ``fn`` is a coroutine that writes with ``context.write`` and
        returns None, so the same guard as for unary methods serves it.

        A write on a call the client has left raises gRPC's ``InternalError`` (its
        ``ExecuteBatchError``), while ``context.cancelled()`` and ``context.done()`` still
        say False; the handler is often, not always, cancelled first. Such a stream ends
        as CANCELLED, not as a board error with a traceback: a watcher that exits (an
        island shutting down) is routine."""

        @functools.wraps(fn)
        async def writing(request, context):
            try:
                return await self._while_token_valid(method, fn(request, context), context)
            except grpc.aio.InternalError as exc:
                raise _PeerGone(f"{type(exc).__name__}: {exc}") from exc

        return self.unary(method, writing)

    async def _while_token_valid(self, method: str, work: Coroutine[Any, Any, Any],
                                 context: grpc.aio.ServicerContext) -> Any:
        """Run a stream handler as a task of its own, ended as UNAUTHENTICATED (the handler
        cancelled, its ``finally`` run) once its caller's token is revoked: at once when this
        board revokes it, else at the next re-check, every ``recheck_every_s``, by one task per
        token however many streams share it (``Authenticator.revocation``). A re-check Redis
        cannot answer ends nothing: the stream was authorized, and its own Redis reads report
        an outage.

        With auth off the handler runs in this task, as a unary one does."""
        if not self.auth.enabled:
            return await work
        token = bearer(context.invocation_metadata())
        try:
            info = await self.auth.current(token)  # cached since ``enter``
        except BaseException:
            work.close()
            raise
        if info is None:  # revoked since ``enter``
            work.close()
            raise Unauthenticated(f"the token presented to {method} is unknown or revoked")
        revoked = self.auth.revocation(info, token)  # (re-checked by one task per token)
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task, revoked), return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise Unauthenticated(
                f"the token was revoked while its {method} stream was open; ask an admin for a token"
            )
        finally:
            self.auth.forget_revocation(info.token_id, revoked)
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))


def _message_or_bytes(message: Any) -> bytes:
    """Stream serializer: bytes pass through (a WatchEvent serialized once for all watchers)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_board_to_server(
    servicer: Any, auth: Authenticator, metrics: BoardMetrics, redis_url: str, server: grpc.aio.Server
) -> None:
    """Register every method of ``weftboard.v1.Board``, each behind the guard above.

    Built from the service descriptor rather than the generated ``add_BoardServicer_to_server``
    so that server-streaming methods get the pass-through serializer.
    """
    guard = RpcGuard(auth, metrics, redis_url)
    service = pb.DESCRIPTOR.services_by_name["Board"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        fn = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                guard.stream(method.name, fn),
                request_deserializer=request_type.FromString,
                response_serializer=_message_or_bytes,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                guard.unary(method.name, fn),
                request_deserializer=request_type.FromString,
                response_serializer=response_type.SerializeToString,
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
