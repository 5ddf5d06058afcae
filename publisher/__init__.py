"""weftboard.publisher: the trainer side (``Publisher``) and the sync benchmark.

Names are resolved lazily so ``import weftboard.publisher`` stays cheap (no torch).
"""

from typing import Any

__all__ = ["Publisher", "PublishHandle"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from weftboard.publisher import publisher

        return getattr(publisher, name)
    raise AttributeError(f"module 'weftboard.publisher' has no attribute {name!r}")
