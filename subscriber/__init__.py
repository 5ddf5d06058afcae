"""weftboard.subscriber: the island side (``Subscriber``, destinations, the daemon).

Names are resolved lazily so ``import weftboard.subscriber`` stays cheap (no torch).
"""

from typing import Any

_EXPORTS = {
    "Subscriber": "weftboard.subscriber.subscriber",
    "CheckpointDirDestination": "weftboard.subscriber.checkpoint_dir",
    "LiveTensorsDestination": "weftboard.subscriber.live_tensors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weftboard.subscriber' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
