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
