"""SGLang adapter, against its documented weight-update endpoints.

- ``POST /pause_generation`` ``{"mode": "in_place"}``: stop scheduling between steps,
  keeping running requests and their KV cache; in ``drain`` mode the sidecar's gate has
  already emptied the engine, so the same call just stops the scheduler.
- ``POST /update_weights_from_disk`` ``{"model_path": dir, "load_format": "safetensors",
  "weight_version": "<n>", "flush_cache": true}``; SGLang answers 200 with
  ``{"success": false, "message": ...}`` for a load that failed, which is an error too.
- ``POST /continue_generation`` ``{}``; ``GET /get_model_info``; ``GET /health``.

The exact requests are pinned by tests/contracts/sglang.json.
"""

from __future__ import annotations

from pathlib import Path

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.engines.base import ActivationMode, require_mode
from weftboard.subscriber.engines.http import HttpEngineAdapter


class SglangAdapter(HttpEngineAdapter):
    kind = "sglang"

    async def pause(self, mode: ActivationMode) -> None:
        require_mode(mode)
        await self.call("POST", "/pause_generation", json={"mode": "in_place"})

    async def resume(self) -> None:
        await self.call("POST", "/continue_generation", json={})

    async def load_checkpoint(self, directory: Path, version: int) -> None:
        answer = await self.call(
            "POST",
            "/update_weights_from_disk",
            json={
                "model_path": str(directory),
                "load_format": "safetensors",
                "weight_version": str(version),
                "flush_cache": True,
            },
            timeout_s=self.load_timeout_s,
        )
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ApplyError(f"sglang engine at {self.engine_url} refused the weights of version {version}: "
                             f"{answer.get('message', 'no message')}")
        self.mark_served(version)

    async def model_info(self) -> dict:
        return await self.call("GET", "/get_model_info")
