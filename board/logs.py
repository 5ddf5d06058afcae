"""structlog set-up: a library's quiet default, and the commands' readable or JSON logs.

As a library (a trainer importing the Publisher, an application following a run) weftboard
prints nothing of its own: importing ``weftboard.board`` (which every client imports) routes
structlog through the standard ``logging`` module under the ``weftboard.*`` loggers, which
carry a ``NullHandler``; the host's logging configuration decides what is shown and where
(``logging.basicConfig(level=logging.INFO)`` shows weftboard's info lines). A host that
configured structlog itself before importing weftboard keeps its configuration.

A command (``weftboard serve``, ``subscribe``, ...) calls ``configure()`` once at start: JSON
lines when stderr is not a terminal (production, CI, log shippers), a readable console
renderer when it is. Library code only calls ``structlog.get_logger(name)`` and binds context
(run, version, peer).
"""

from __future__ import annotations

import logging
import sys

import structlog

LIBRARY_LOGGER = "weftboard"


def _message_with_fields(_logger: object, _name: str, event_dict: dict) -> str:
    """``event key=value ...``: one line for whatever formatter the host's logging uses."""
    event = event_dict.pop("event", "")
    event_dict.pop("level", None)
    fields = " ".join(f"{key}={value!r}" if isinstance(value, str) and " " in value else f"{key}={value}"
                      for key, value in sorted(event_dict.items()))
    return f"{event} {fields}" if fields else str(event)


def library_defaults() -> None:
    """Route structlog through stdlib ``logging`` (quiet until the host configures logging),
    unless structlog is configured already. Called when ``weftboard.board`` is imported."""
    logging.getLogger(LIBRARY_LOGGER).addHandler(logging.NullHandler())
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            _message_with_fields,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


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
