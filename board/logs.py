"""structlog set-up shared by every weftboard process.

JSON lines when stderr is not a terminal (production, CI, log shippers), a readable
console renderer when it is. Call ``configure()`` once at process start; library code
only calls ``structlog.get_logger()`` and binds context (run, version, peer).
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(json: bool | None = None, level: str = "INFO") -> None:
    """Route structlog (and stdlib logging) to stderr; ``json=None`` picks by terminal."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    numeric = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=numeric, format="%(message)s")
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if use_json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # Not cached: a cached logger ignores later reconfiguration (tests capture logs).
        cache_logger_on_first_use=False,
    )


# grpc's asyncio server reports, on this stdlib logger, an ERROR with a traceback when a
# handler's response cannot be sent because its call has already ended: the client cancelled
# it, its connection closed, or the server is stopping. grpc itself drops the case when it has
# already seen the client close; the rest is the same event seen a moment early. Nothing on the
# board failed, and it is routine (an island stopped mid-heartbeat), so ``UndeliveredResponses``
# turns each into one structured info line naming the method.
GRPC_CORE_LOGGER = "grpc._cython.cygrpc"
_UNDELIVERED = "ExecuteBatchError raised in core by servicer method"

_log = structlog.get_logger(__name__)


class UndeliveredResponses(logging.Filter):
    """Drops grpc's undelivered-response tracebacks for an info line; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name != GRPC_CORE_LOGGER or not message.startswith(_UNDELIVERED):
            return True
        method = message[len(_UNDELIVERED):].strip().strip("[]")
        error = record.exc_info[1] if record.exc_info else None
        _log.info("rpc response not delivered: the call had ended (client cancelled or gone, or the board "
                  "stopping)", method=method, error=type(error).__name__ if error else None)
        return False


def quiet_undelivered_responses() -> None:
    """Install ``UndeliveredResponses`` on grpc's logger once per process (any board server calls it)."""
    logger = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, UndeliveredResponses) for f in logger.filters):
        logger.addFilter(UndeliveredResponses())
