"""Choosing an engine adapter by name: the registry above the adapters.

``ADAPTERS`` maps each ``--engine`` name to a factory; each adapter lives in its own module
(``reference``, ``vllm``, ``sglang``) and imports only ``base`` and ``http``, so no adapter
module imports another and ``base`` imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weftboard.proto.errors import InvalidArgument
from weftboard.subscriber.engines.base import EngineAdapter
from weftboard.subscriber.engines.reference import (
    ReferenceAdapter,
    ReferenceHttpAdapter,
)
from weftboard.subscriber.engines.sglang import SglangAdapter
from weftboard.subscriber.engines.vllm import VllmAdapter

#: ``factory(engine_url, engine=..., **options)``: engine_url may be None only where the
#: engine can run in this process (``engine``).
AdapterFactory = Callable[..., EngineAdapter]


def _reference(engine_url: str | None, *, engine: Any = None, **options: Any) -> EngineAdapter:
    if engine is not None:
        return ReferenceAdapter(engine)
    if not engine_url:
        raise InvalidArgument("--engine reference needs an in-process engine or --engine-url")
    return ReferenceHttpAdapter(engine_url, **options)


def _over_http(adapter: Callable[..., EngineAdapter], kind: str) -> AdapterFactory:
    def make(engine_url: str | None, *, engine: Any = None, **options: Any) -> EngineAdapter:
        if not engine_url:
            raise InvalidArgument(f"--engine {kind} needs --engine-url (where the engine serves HTTP)")
        return adapter(engine_url, **options)

    return make


ADAPTERS: dict[str, AdapterFactory] = {
    "reference": _reference,
    "vllm": _over_http(VllmAdapter, "vllm"),
    "sglang": _over_http(SglangAdapter, "sglang"),
}


def make_adapter(kind: str, engine_url: str | None = None, *, engine: Any = None, **options: Any) -> EngineAdapter:
    """The adapter for ``--engine kind`` (one of ``ADAPTERS``)."""
    factory = ADAPTERS.get(kind)
    if factory is None:
        raise InvalidArgument(f"unknown engine {kind!r}: use {', '.join(ADAPTERS)}")
    return factory(engine_url, engine=engine, **options)
