"""Shared HTTP plumbing for adapters of engines that run in their own process.

Invariants:
- Every call has a timeout; a non-2xx answer or an unreachable engine becomes
  ``ApplyError`` naming the engine, the method, the path and what the engine said
  (``EngineNoAnswer`` when the request went out but no answer came: timed out, connection lost).
- A weight change (``change_weights``) that got no answer leaves the engine on weights nobody
  vouches for (it may still be loading): the adapter is ``mark_unverified``. An answered error
  (``EngineErrorAnswer``) is the engine's word that it did not take the change only where its
  loads are transactional (``error_answer_keeps_weights``, the default); an adapter of an engine
  that may fail part-way through a change (vLLM) sets it False and is ``mark_unverified`` too.
- Timeouts in messages keep their fractions ("within 0.3s", never "within 0s").
- With an ``api_key`` every call carries ``Authorization: Bearer <key>`` (an engine started
  with ``--api-key`` answers 401 otherwise); the key never appears in an error message.
- An idle connection is reused for at most ``ENGINE_KEEPALIVE_S``, below the 5 s after which
  uvicorn (vLLM's and SGLang's server) closes it, so no request goes out on a connection the
  engine has already closed (aiohttp keeps them 15 s: "Server disconnected").
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.engines.base import EngineAdapter


class EngineUnreachable(ApplyError):
    """No connection to the engine: the call never reached it (down, or not listening yet)."""


class EngineNoAnswer(ApplyError):
    """A call went out and no answer came back (timed out, connection lost): what the engine did is unknown."""


class EngineErrorAnswer(ApplyError):
    """The engine answered a call with a non-2xx status (``status``; its body, cut, is in the message)."""

    def __init__(self, message: str, *, status: int, body: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


#: seconds an idle connection to an engine stays in the pool; uvicorn closes its side at 5 s.
ENGINE_KEEPALIVE_S = 2.0


def engine_session(keepalive_s: float = ENGINE_KEEPALIVE_S) -> aiohttp.ClientSession:
    """A client session for an engine's HTTP server, dropping idle connections before the engine does."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=keepalive_s))


class HttpEngineAdapter(EngineAdapter):
    #: the model name clients know the engine by, where the engine's own answers stop
    #: showing it (SGLang renames its model to the folder it loads); None: the engine's
    #: answers stand. The island reports this name in ``/v1/models``.
    served_model_name: str | None = None
    #: whether an error answer to ``change_weights`` leaves the engine's weights as they were (its
    #: loads are transactional); False: the outcome is unknown and the adapter is ``mark_unverified``
    error_answer_keeps_weights: bool = True

    def __init__(
        self,
        engine_url: str,
        *,
        timeout_s: float = 30.0,
        load_timeout_s: float = 600.0,
        api_key: str | None = None,
        keepalive_s: float = ENGINE_KEEPALIVE_S,
    ) -> None:
        super().__init__()
        self.keepalive_s = keepalive_s
        self.engine_url = engine_url.rstrip("/")
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = engine_session(self.keepalive_s)
        return self._session

    async def call(
        self,
        method: str,
        path: str,
        *,
        json: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One request to the engine; the decoded JSON answer (or text) on 2xx, else ApplyError."""
        url = self.engine_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._client().request(method, url, json=json, params=params, headers=self._headers,
                                              timeout=timeout) as resp:
                text = await resp.text()
                if resp.status >= 300:
                    raise EngineErrorAnswer(
                        f"{self.kind} engine at {self.engine_url} answered {resp.status} to {method} {path}: {text[:500]}",
                        status=resp.status, body=text[:500],
                    )
                if "json" in resp.headers.get("Content-Type", ""):
                    return await resp.json(content_type=None)
                return text
        except aiohttp.ClientConnectorError as exc:  # no connection: the request never reached the engine
            raise EngineUnreachable(f"{self.kind} engine at {self.engine_url} unreachable for {method} {path}: {exc}"
                                    ) from exc
        except aiohttp.ClientError as exc:  # the request may have reached it; its answer did not come back
            raise EngineNoAnswer(f"{self.kind} engine at {self.engine_url} unreachable for {method} {path}: {exc}") from exc
        except TimeoutError as exc:
            raise EngineNoAnswer(
                f"{self.kind} engine at {self.engine_url} did not answer {method} {path} within "
                f"{timeout_s or self.timeout_s:g}s"
            ) from exc

    async def change_weights(
        self, method: str, path: str, *, json: Mapping[str, Any] | None = None, what: str | None = None
    ) -> Any:
        """``call`` for a request that changes the engine's weights (bounded by ``load_timeout_s``).
        Without an answer (or cancelled while it runs) the engine may still be changing them, and
        with an error answer where ``error_answer_keeps_weights`` is False it may have changed some:
        the adapter vouches for no version (``mark_unverified``, naming ``what``, by default the
        method and path) before the error goes on."""
        what = what or f"{method} {path}"
        try:
            return await self.call(method, path, json=json, timeout_s=self.load_timeout_s)
        except EngineNoAnswer as exc:
            self.mark_unverified(f"{what} got no answer; the engine may still be changing its weights: {exc}")
            raise
        except EngineErrorAnswer as exc:
            if not self.error_answer_keeps_weights:
                self.mark_unverified(f"{what} answered HTTP {exc.status}; the engine may have changed part of "
                                     f"its weights: {exc}")
            raise
        except asyncio.CancelledError:
            self.mark_unverified(f"{what} was cancelled; the engine may still be changing its weights")
            raise

    @property
    def probe_timeout_s(self) -> float:
        """How long each request of a health probe may take: ``timeout_s``, at most 5 s."""
        return min(self.timeout_s, 5.0)

    async def health_answer(self) -> Any:
        """The engine's answer to its health endpoint (within ``probe_timeout_s``), else ApplyError."""
        return await self.call("GET", "/health", timeout_s=self.probe_timeout_s)

    async def health(self) -> bool:
        try:
            await self.health_answer()
        except ApplyError:
            return False
        return True

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
