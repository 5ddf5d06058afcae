"""weftboard.publisher: the trainer side (``Publisher``); its benchmarks live in ``bench/``."""

from weftboard.publisher.publisher import Publisher, PublishHandle

__all__ = ["Publisher", "PublishHandle"]
