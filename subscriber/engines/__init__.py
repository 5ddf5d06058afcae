"""Engine adapters: one small port (``base.EngineAdapter``) and one adapter per engine."""

from weftboard.subscriber.engines.base import (
    ActivationMode,
    EngineAdapter,
    make_adapter,
)

__all__ = ["ActivationMode", "EngineAdapter", "make_adapter"]
