"""vLLM adapter, against the server's RL endpoints (``VLLM_SERVER_DEV_MODE=1``).

The endpoints (vLLM docs "Async Reinforcement Learning" and
``vllm/entrypoints/serve/rlhf/api_router.py``):
- ``POST /pause?mode=wait|keep&clear_cache=true``: ``wait`` lets in-flight requests
  finish first (our ``drain``); ``keep`` freezes them in the scheduler and they resume
  on the new weights (our ``in_place``). ``clear_cache`` drops KV/prefix cache computed
  with the old weights.
- ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": dir}}``:
  every worker reloads the checkpoint directory from disk (vLLM's weight-transfer
  ``/update_weights`` path moves tensors over NCCL/IPC, which an island without the
  trainer's fabric does not have; the subscriber has already written the verified
  checkpoint to local disk).
- ``POST /reset_prefix_cache`` after a reload; ``POST /resume``; ``GET /health``.

The exact requests are pinned by tests/contracts/vllm.json.
"""

from __future__ import annotations

from pathlib import Path

from weftboard.subscriber.engines.base import ActivationMode, require_mode
from weftboard.subscriber.engines.http import HttpEngineAdapter

_PAUSE_MODE = {ActivationMode.DRAIN: "wait", ActivationMode.IN_PLACE: "keep"}


class VllmAdapter(HttpEngineAdapter):
    kind = "vllm"

    async def pause(self, mode: ActivationMode) -> None:
        await self.call("POST", "/pause", params={"mode": _PAUSE_MODE[require_mode(mode)], "clear_cache": "true"},
                        timeout_s=self.load_timeout_s)

    async def resume(self) -> None:
        await self.call("POST", "/resume")

    async def load_checkpoint(self, directory: Path, version: int) -> None:
        await self.call(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(directory)}},
            timeout_s=self.load_timeout_s,
        )
        await self.call("POST", "/reset_prefix_cache")
        self.mark_served(version)
