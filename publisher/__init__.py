"""weftboard.publisher: the trainer side (``Publisher``, ``ShardedPublisher`` and, with transformers
installed, ``WeftboardCallback``); its benchmarks live in ``bench/``.

The names are loaded on first use (PEP 562), so importing a light submodule (the command line's
``commands``, the WAN simulator's settings) does not load torch and the codec's kernels."""

import importlib
from typing import Any

# WeftboardCallback is not in __all__: `import *` must work without transformers.
__all__ = ["Publisher", "PublishHandle", "ShardedPublisher", "Slice"]

# name -> the module that defines it (transformers is optional: the callback's module needs it)
_HOMES = {
    "Publisher": "weftboard.publisher.publisher",
    "PublishHandle": "weftboard.publisher.publisher",
    "ShardedPublisher": "weftboard.publisher.sharded",
    "Slice": "weftboard.publisher.sharded",
    "WeftboardCallback": "weftboard.publisher.hf_callback",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
