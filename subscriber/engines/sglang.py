"""SGLang adapter: a new version is loaded whole from the island's checkpoint folder.

Requests (pinned by tests/contracts/sglang.json; read against SGLang 0.5.23's
``srt/entrypoints/http_server.py`` (``GET /model_info``, ``GET /health`` too), ``srt/managers/io_struct.py``, ``tokenizer_manager.py``,
``scheduler.py``):
- ``in_place``: ``POST /pause_generation {"mode": "retract"}`` stops the scheduler between two
  steps and sends running requests back to its queue, KV freed; after ``POST
  /continue_generation {}`` they recompute it on the new weights and go on. SGLang's own
  ``"in_place"`` mode keeps their KV, and the cache flush a weight change needs then fails
  (older SGLang: the scheduler asserts and dies); ``"abort"`` would end them.
- ``drain``: no pause (the gate has drained the sidecar's requests); an update on an unpaused
  engine waits on SGLang's model-update lock for any other request, holding new ones.
- ``POST /update_weights_from_disk {"model_path", "load_format": "safetensors",
  "weight_version", "flush_cache": true, "abort_all_requests": false}``: the engine flushes
  the cache of the old weights itself. ``{"success": false, "message"}`` (status 400, or 200
  in older SGLang) raises ``ApplyError`` with the engine's message.

Invariants: a refused update (an error answer, ``success: false``) leaves the previous version:
SGLang rolls its weights back itself; an update it never answered leaves no version vouched for
(``change_weights``). ``served_model_name`` is the name the engine served under before this adapter's
first load (read by ``warm_up`` unless given). A successful load renames SGLang's served
model to ``model_path`` and no request field prevents it; completions do not check the
``model`` field, but ``/v1/models`` would list the island's folder, so the sidecar lists this
name instead. An engine an earlier island already renamed needs the name given.

Needs ``/pause_generation`` with a ``mode`` (SGLang after 0.5.5) and a cache flush that
ignores the waiting queue while paused. With ``--admin-api-key``, that key is the ``api_key``.
The health probe also reads ``/model_info``'s ``weight_version``, which each load sets to the
island's version and a restart resets: a restart between two probes is seen.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import structlog

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.engines.base import ActivationMode, require_mode
from weftboard.subscriber.engines.http import (
    EngineErrorAnswer,
    EngineNoAnswer,
    EngineUnreachable,
    HttpEngineAdapter,
)

log = structlog.get_logger(__name__)

#: ``/pause_generation`` mode per activation mode; None: no pause (the engine's update lock drains)
PAUSE_MODE: dict[ActivationMode, str | None] = {ActivationMode.DRAIN: None, ActivationMode.IN_PLACE: "retract"}
_WARM_UP_RETRY_S = 1.0  # how often a starting engine is asked for its model's name
_WARM_UP_LOG_S = 30.0  # how often the wait for it is logged


class SglangAdapter(HttpEngineAdapter):
    kind = "sglang"

    def __init__(
        self,
        engine_url: str,
        *,
        timeout_s: float = 30.0,
        load_timeout_s: float = 600.0,
        api_key: str | None = None,
        served_model_name: str | None = None,
    ) -> None:
        super().__init__(engine_url, timeout_s=timeout_s, load_timeout_s=load_timeout_s, api_key=api_key)
        self.served_model_name = served_model_name
        self._paused = False  # whether resume has a /pause_generation to undo
        self._model_info_path = "/model_info"  # "/get_model_info" once an older SGLang answered 404

    async def warm_up(self) -> float:
        """Record the name the engine serves its model under, before a load renames it. An
        engine still starting (no connection, no answer, or an error status while it loads: a
        sidecar started beside its engine) is asked again every ``_WARM_UP_RETRY_S`` until
        ``load_timeout_s`` has passed, logged now and then; after that the last error is raised."""
        started = time.monotonic()
        next_log = started
        while self.served_model_name is None:
            try:
                answer = await self.call("GET", "/v1/models")
            except (EngineUnreachable, EngineNoAnswer, EngineErrorAnswer) as exc:
                waited = time.monotonic() - started
                if waited >= self.load_timeout_s:
                    raise ApplyError(f"{exc} (asked for {waited:.0f} s while it started)") from None
                if time.monotonic() >= next_log:
                    log.info("waiting for the sglang engine to answer", engine=self.engine_url,
                             waited_s=round(waited), error=str(exc))
                    next_log = time.monotonic() + _WARM_UP_LOG_S
                await asyncio.sleep(_WARM_UP_RETRY_S)
                continue
            self.served_model_name = first_model_id(answer, self.engine_url)  # an answer without one: at once
        return time.monotonic() - started

    async def pause(self, mode: ActivationMode) -> None:
        sglang_mode = PAUSE_MODE[require_mode(mode)]
        if sglang_mode is not None:
            self._paused = True  # set first: a pause that failed half-way is undone by resume too
            await self.call("POST", "/pause_generation", json={"mode": sglang_mode})

    async def resume(self) -> None:
        if self._paused:
            await self.call("POST", "/continue_generation", json={})
            self._paused = False

    async def load_checkpoint(self, directory: Path, version: int) -> None:
        if self.served_version() == 0 and self.served_model_name == str(directory):
            log.warning("the sglang engine already serves its model under the island's folder name (an earlier "
                        "island's load renamed it); give served_model_name to report the original name",
                        engine=self.engine_url)
        try:
            answer = await self.change_weights(
                "POST",
                "/update_weights_from_disk",
                json={
                    "model_path": str(directory),
                    "load_format": "safetensors",
                    "weight_version": str(version),
                    "flush_cache": True,
                    "abort_all_requests": False,
                },
            )
        except ApplyError as exc:
            raise ApplyError(f"sglang engine did not take the weights of version {version} from {directory}: "
                             f"{exc}") from exc
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ApplyError(f"sglang engine at {self.engine_url} refused the weights of version {version} from "
                             f"{directory}: {answer.get('message', 'no message')}")
        self.mark_served(version)

    async def model_info(self, timeout_s: float | None = None) -> dict:
        """SGLang's ``/model_info`` (``/get_model_info`` on an SGLang without it, after one 404)."""
        if self._model_info_path == "/model_info":
            try:
                return await self.call("GET", "/model_info", timeout_s=timeout_s)
            except EngineErrorAnswer as exc:
                if exc.status != 404:
                    raise
                self._model_info_path = "/get_model_info"
        return await self.call("GET", self._model_info_path, timeout_s=timeout_s)

    async def health_answer(self) -> Any:
        """``/health``, and once a version is served, the weight version SGLang reports as
        ``{"version": v}`` (as the reference engine answers): each load sets it to the island's
        version (``weight_version``), and an engine restarted between two probes reports its
        start-up one (``default``: 0), so the island sees the restart. An SGLang that reports
        none is judged by its health answer alone. Each ask within ``probe_timeout_s``, as the health check."""
        answer = await super().health_answer()
        if not self.served_version():
            return answer
        info = await self.model_info(timeout_s=self.probe_timeout_s)
        reported = info.get("weight_version") if isinstance(info, dict) else None
        if reported is None:
            return answer
        return {"version": int(reported) if str(reported).isdigit() else 0}


def first_model_id(answer: Any, engine_url: str) -> str:
    """The ``id`` of the first model in an OpenAI ``/v1/models`` answer (SGLang lists its
    base model first, then LoRA adapters)."""
    try:
        model_id = answer["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        model_id = None
    if not isinstance(model_id, str) or not model_id:
        raise ApplyError(f"sglang engine at {engine_url} answered GET /v1/models without a model id: "
                         f"{str(answer)[:300]}")
    return model_id
