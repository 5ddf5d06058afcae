"""The reference engine's OpenAI-compatible HTTP server, and its admin endpoints.

``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE streams, with log-probs),
``/v1/models``, ``/health``; ``/admin/*`` (pause, resume, load a checkpoint directory) is
what ``engines.reference.ReferenceHttpAdapter`` drives when the engine runs in its own
process (``python -m weftboard.subscriber.reference_engine.openai_api``).

Invariant: a checkpoint is loaded only while the engine is paused (409 otherwise), and a
failed load leaves the served weights and version as they were.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from weftboard.proto.errors import ApplyError, InvalidArgument
from weftboard.subscriber.reference_engine.engine import GeneratedToken, ReferenceEngine


def _prompt_of(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise InvalidArgument("the reference engine takes one string prompt per request")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidArgument("prompt must be a string")
    return prompt


def _chat_prompt(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list of {role, content}")
    return "\n".join(str(m.get("content", "")) for m in messages) + "\n"


def _stop_of(body: Mapping[str, Any]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    return [stop] if isinstance(stop, str) else [str(s) for s in stop]


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def build_app(engine: ReferenceEngine) -> web.Application:
    """The aiohttp application: OpenAI completions/chat (with SSE), health, models, admin."""
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": engine.version})

    @routes.get("/v1/models")
    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": engine.name, "object": "model", "owned_by": "weftboard",
                                         "max_model_len": engine.config["max_seq"]}]}
        )

    async def run_request(request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body must be JSON")
        try:
            prompt = _chat_prompt(body) if chat else _prompt_of(body)
            max_tokens = int(body.get("max_tokens", body.get("max_completion_tokens", 16)))
            temperature = float(body.get("temperature", 1.0))
            seed = body.get("seed")
            want_logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
            stream = bool(body.get("stream", False))
            stop = _stop_of(body)
            prompt_tokens = len(engine.tokenizer.encode(prompt))
            tokens = engine.generate(prompt, max_tokens=max_tokens, temperature=temperature,
                                     seed=None if seed is None else int(seed), stop=stop)
        except (InvalidArgument, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        def _stopped(token_id: int, text: str) -> bool:
            return token_id == engine.tokenizer.eos_id or bool(stop and any(s and text.endswith(s) for s in stop))

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = body.get("model") or engine.name
        finish = "length"
        out: list[GeneratedToken] = []
        if not stream:
            try:
                async for tok in tokens:
                    out.append(tok)
            except InvalidArgument as exc:
                return _error(400, str(exc))
            if out and _stopped(out[-1].token_id, "".join(t.text for t in out)):
                finish = "stop"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(out),
                     "total_tokens": prompt_tokens + len(out)}
            text = "".join(t.text for t in out)
            if chat:
                choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": finish, "logprobs": None}
                if want_logprobs:
                    choice["logprobs"] = {"content": [{"token": t.text, "logprob": t.logprob, "bytes": None,
                                                       "top_logprobs": []} for t in out]}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
                if want_logprobs:
                    offsets, pos = [], len(prompt)
                    for t in out:
                        offsets.append(pos)
                        pos += len(t.text)
                    choice["logprobs"] = {"tokens": [t.text for t in out], "token_logprobs": [t.logprob for t in out],
                                          "top_logprobs": None, "text_offset": offsets}
            return web.json_response({
                "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": [choice], "usage": usage,
                "engine_versions": sorted({t.version for t in out}),
            })

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: Mapping[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        count = 0
        text = ""
        async for tok in tokens:
            count += 1
            text += tok.text
            if chat:
                choice = {"index": 0, "delta": {"content": tok.text}, "finish_reason": None, "logprobs": None}
                if want_logprobs:
                    choice["logprobs"] = {"content": [{"token": tok.text, "logprob": tok.logprob, "bytes": None,
                                                       "top_logprobs": []}]}
            else:
                choice = {"index": 0, "text": tok.text, "finish_reason": None, "logprobs": None}
                if want_logprobs:
                    choice["logprobs"] = {"tokens": [tok.text], "token_logprobs": [tok.logprob],
                                          "top_logprobs": None, "text_offset": [len(prompt) + len(text) - len(tok.text)]}
            await send({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                        "engine_version": tok.version})
            if _stopped(tok.token_id, text):
                finish = "stop"
        final_choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        final_choice.update({"delta": {}} if chat else {"text": ""})
        await send({"id": rid, "object": obj, "created": created, "model": model, "choices": [final_choice],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": count,
                              "total_tokens": prompt_tokens + count}})
        await send("[DONE]")
        await response.write_eof()
        return response

    @routes.post("/v1/completions")
    async def completions(request: web.Request) -> web.StreamResponse:
        return await run_request(request, chat=False)

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await run_request(request, chat=True)

    # Admin endpoints driven by ReferenceHttpAdapter when the engine runs in its own process.

    @routes.get("/admin/version")
    async def admin_version(_: web.Request) -> web.Response:
        return web.json_response({"version": engine.version, "paused": engine.paused})

    @routes.post("/admin/pause")
    async def admin_pause(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            await engine.pause(str(body.get("mode", "drain")))
        except InvalidArgument as exc:
            return _error(400, str(exc))
        return web.json_response({"paused": True})

    @routes.post("/admin/resume")
    async def admin_resume(_: web.Request) -> web.Response:
        await engine.resume()
        return web.json_response({"paused": False})

    @routes.post("/admin/load_checkpoint")
    async def admin_load(request: web.Request) -> web.Response:
        body = await request.json()
        if not engine.paused:
            return _error(409, "pause the engine before loading a checkpoint", "conflict")
        try:
            await asyncio.to_thread(engine.load_checkpoint_dir, Path(body["path"]))
        except (ApplyError, OSError, KeyError) as exc:
            return _error(500, f"load failed: {exc}", "server_error")
        engine.version = int(body.get("version", 0))
        return web.json_response({"version": engine.version})

    app = web.Application()
    app.add_routes(routes)
    return app


@dataclass
class RunningEngineServer:
    """An engine's HTTP server started in the current event loop."""

    engine: ReferenceEngine
    url: str
    _runner: web.AppRunner

    async def stop(self) -> None:
        await self._runner.cleanup()


async def serve_engine(engine: ReferenceEngine, host: str = "127.0.0.1", port: int = 0) -> RunningEngineServer:
    """Start the OpenAI-compatible server on ``host:port`` (0 picks a free port)."""
    runner = web.AppRunner(build_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return RunningEngineServer(engine, f"http://{host}:{bound}", runner)


def main(argv: list[str] | None = None) -> None:
    """``python -m weftboard.subscriber.reference_engine.openai_api --listen 127.0.0.1:8001``: an engine of its own."""
    parser = argparse.ArgumentParser(description="weftboard reference engine (OpenAI-compatible)")
    parser.add_argument("--listen", default="127.0.0.1:8001")
    parser.add_argument("--config", default=None, help="JSON file with model config overrides")
    parser.add_argument("--checkpoint", default=None, help="load this checkpoint directory at start")
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    overrides = json.loads(Path(args.config).read_text()) if args.config else None
    host, _, port = args.listen.rpartition(":")

    async def run() -> None:
        engine = ReferenceEngine(overrides, token_delay_s=args.token_delay_s)
        if args.checkpoint:
            engine.load_checkpoint_dir(Path(args.checkpoint))
        server = await serve_engine(engine, host or "127.0.0.1", int(port))
        print(f"reference engine serving on {server.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()

    asyncio.run(run())


if __name__ == "__main__":
    main()
