"""weftboard.publisher: the trainer side (``Publisher``, ``ShardedPublisher`` and, with transformers
installed, ``WeftboardCallback``); its benchmarks live in ``bench/``."""

from typing import Any

from weftboard.publisher.publisher import Publisher, PublishHandle
from weftboard.publisher.sharded import ShardedPublisher, Slice

# WeftboardCallback is not in __all__: `import *` must work without transformers.
__all__ = ["Publisher", "PublishHandle", "ShardedPublisher", "Slice"]


def __getattr__(name: str) -> Any:
    if name == "WeftboardCallback":
        # transformers is optional: imported only when the callback is asked for
        from weftboard.publisher.hf_callback import WeftboardCallback

        return WeftboardCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
