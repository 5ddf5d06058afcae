"""The reference engine: a tiny causal LM in plain torch and its OpenAI-compatible server.

It exists so that tests and ``weftboard demo`` exercise a real engine end to end on a CPU:
real weights that the subscriber patches in place, real sampling with log-probs, real
streaming. It is not meant to be good at language.

Invariants:
- The served weights are the bf16 tensors in ``ReferenceEngine.tensors``; they are only
  ever modified in place (``copy_``/patch apply), so their storage never moves and a
  holder of a reference (the subscriber's live-tensor destination) always sees them.
- ``forward`` is a pure function of a parameter mapping, so the trainer (fp32 masters,
  autograd) and the engine (bf16, inference) run the very same model.
- A decoding step holds ``step_lock``; a weight change holds it too, so one token is
  always computed from one version's weights (never a mix). ``version_at_step`` lists
  the version each generated token was computed with.
- Nothing here downloads anything: the model is built from a config dict and a seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from weftboard.proto.errors import ApplyError, InvalidArgument

# ---------------------------------------------------------------------------
# Tokenizer and config
# ---------------------------------------------------------------------------

EOS = "\x00"
_ALPHABET = EOS + " abcdefghijklmnopqrstuvwxyz0123456789.,!?:;'-\n"


class CharTokenizer:
    """One token per character of a fixed alphabet; unknown characters become '?'."""

    def __init__(self, alphabet: str = _ALPHABET) -> None:
        self.alphabet = alphabet
        self._index = {ch: i for i, ch in enumerate(alphabet)}
        self.eos_id = 0

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        unknown = self._index["?"]
        return [self._index.get(ch, unknown) for ch in text.lower()]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] for i in ids if i != self.eos_id)

    def token(self, token_id: int) -> str:
        return "" if token_id == self.eos_id else self.alphabet[token_id]


DEFAULT_CONFIG: dict[str, Any] = {
    "name": "weftboard-reference",
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "d_ff": 128,
    "max_seq": 128,
    "seed": 0,
}


def model_config(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    config = dict(DEFAULT_CONFIG)
    config.update(overrides or {})
    config["vocab_size"] = CharTokenizer().vocab_size
    if config["d_model"] % config["n_heads"]:
        raise InvalidArgument(f"d_model {config['d_model']} must be a multiple of n_heads {config['n_heads']}")
    return config


def parameter_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names (HF llama-like layout) and shapes, in a fixed order."""
    d, f, v = config["d_model"], config["d_ff"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, d),
        "model.embed_positions.weight": (config["max_seq"], d),
    }
    for i in range(config["n_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (d, d)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def init_parameters(config: Mapping[str, Any], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic initial weights from ``config['seed']`` (same bits on every machine)."""
    gen = torch.Generator().manual_seed(int(config["seed"]))
    params: dict[str, torch.Tensor] = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            std = 0.02 if "embed" in name else 1.0 / math.sqrt(shape[-1])
            t = torch.randn(shape, generator=gen) * std
        params[name] = t.to(dtype).contiguous()
    return params


# ---------------------------------------------------------------------------
# The model, as a pure function of its parameters
# ---------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def forward(params: Mapping[str, torch.Tensor], ids: torch.Tensor, config: Mapping[str, Any]) -> torch.Tensor:
    """Logits (float32, [B, T, V]) for token ids [B, T]; params may be bf16 or fp32."""
    p = {k: v.float() for k, v in params.items()}
    b, t = ids.shape
    if t > config["max_seq"]:
        raise InvalidArgument(f"sequence of {t} tokens exceeds the model's max_seq {config['max_seq']}")
    h = config["n_heads"]
    x = p["model.embed_tokens.weight"][ids] + p["model.embed_positions.weight"][:t]
    for i in range(config["n_layers"]):
        pre = f"model.layers.{i}."
        y = _rms_norm(x, p[pre + "input_layernorm.weight"])
        q, k, v = (
            (y @ p[pre + f"self_attn.{n}_proj.weight"].T).view(b, t, h, -1).transpose(1, 2)
            for n in ("q", "k", "v")
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + att.transpose(1, 2).reshape(b, t, -1) @ p[pre + "self_attn.o_proj.weight"].T
        y = _rms_norm(x, p[pre + "post_attention_layernorm.weight"])
        gate = F.silu(y @ p[pre + "mlp.gate_proj.weight"].T)
        x = x + (gate * (y @ p[pre + "mlp.up_proj.weight"].T)) @ p[pre + "mlp.down_proj.weight"].T
    x = _rms_norm(x, p["model.norm.weight"])
    return x @ p["lm_head.weight"].T


def sequence_logprobs(
    params: Mapping[str, torch.Tensor], prompt_ids: list[int], completion_ids: list[int], config: Mapping[str, Any]
) -> torch.Tensor:
    """Log-probs of ``completion_ids`` given ``prompt_ids`` (differentiable for fp32 params)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = forward(params, ids[:, :-1], config)[0, len(prompt_ids) - 1 :]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


@dataclass
class GeneratedToken:
    token_id: int
    text: str
    logprob: float
    version: int


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[GeneratedToken] = field(default_factory=list)
    finish_reason: str = "length"

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


class ReferenceEngine:
    """Holds the served bf16 weights and generates from them one step at a time."""

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        *,
        token_delay_s: float = 0.0,
    ) -> None:
        self.config = model_config(config)
        self.tokenizer = CharTokenizer()
        self.tensors: dict[str, torch.Tensor] = init_parameters(self.config, torch.bfloat16)
        self.version = 0
        self.token_delay_s = token_delay_s
        self.step_lock = asyncio.Lock()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()

    @property
    def name(self) -> str:
        return str(self.config["name"])

    @property
    def paused(self) -> bool:
        return self._paused

    # -- weights -----------------------------------------------------------

    def layout(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(n, "bfloat16", tuple(t.shape)) for n, t in self.tensors.items()]

    def copy_weights_(self, new: Mapping[str, torch.Tensor]) -> None:
        """Overwrite every served tensor in place; all names and shapes are checked first."""
        missing = set(self.tensors) - set(new)
        if missing:
            raise ApplyError(f"checkpoint lacks {len(missing)} tensors of the model, e.g. {sorted(missing)[0]!r}")
        for name, dst in self.tensors.items():
            src = new[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ApplyError(f"tensor {name!r} has shape {tuple(src.shape)}, the model needs {tuple(dst.shape)}")
        for name, dst in self.tensors.items():
            dst.copy_(new[name].to(torch.bfloat16))

    def load_checkpoint_dir(self, directory: Path) -> None:
        """Read every ``*.safetensors`` shard of ``directory`` and copy it into the weights."""
        from safetensors.torch import load_file

        shards = sorted(Path(directory).glob("*.safetensors"))
        if not shards:
            raise ApplyError(f"no *.safetensors files in {directory}")
        merged: dict[str, torch.Tensor] = {}
        for shard in shards:
            merged.update(load_file(str(shard)))
        self.copy_weights_(merged)

    # -- pause / resume ----------------------------------------------------

    async def pause(self, mode: str) -> None:
        """``drain``: wait for running generations to finish and start none; ``in_place``:
        stop between two decoding steps (generations resume where they were)."""
        if self._paused:
            return
        self._paused = True
        self._unpaused.clear()
        if mode == "drain":
            await self._idle.wait()
        elif mode != "in_place":
            self._paused = False
            self._unpaused.set()
            raise InvalidArgument(f"unknown pause mode {mode!r}: use 'drain' or 'in_place'")
        await self.step_lock.acquire()

    async def resume(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if self.step_lock.locked():
            self.step_lock.release()
        self._unpaused.set()

    # -- generation --------------------------------------------------------

    def _sample(self, ids: list[int], temperature: float, gen: torch.Generator) -> tuple[int, float]:
        window = ids[-self.config["max_seq"] :]
        with torch.no_grad():
            logits = forward(self.tensors, torch.tensor([window]), self.config)[0, -1]
        logprobs = torch.log_softmax(logits, -1)
        if temperature <= 0:
            token = int(torch.argmax(logprobs))
        else:
            probs = torch.softmax(logits / temperature, -1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        return token, float(logprobs[token])

    def generate(
        self,
        prompt: str,
        *,
        max_tokens: int = 16,
        temperature: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> AsyncIterator[GeneratedToken]:
        """Validate at once (so a server can answer 400 before streaming), then yield tokens."""
        if max_tokens < 1:
            raise InvalidArgument("max_tokens must be >= 1")
        prompt_ids = self.tokenizer.encode(prompt) or [self.tokenizer.encode(" ")[0]]
        if len(prompt_ids) >= self.config["max_seq"]:
            raise InvalidArgument(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the context of {self.config['max_seq']}"
            )
        gen = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
        return self._generate(prompt_ids, max_tokens, temperature, gen, stop)

    async def _generate(
        self, prompt_ids: list[int], max_tokens: int, temperature: float, gen: torch.Generator, stop: list[str] | None
    ) -> AsyncIterator[GeneratedToken]:
        """Yield tokens one by one; each step holds ``step_lock`` so weights cannot change mid-token."""
        while self._paused:
            await self._unpaused.wait()
        self._active += 1
        self._idle.clear()
        try:
            ids = list(prompt_ids)
            text = ""
            for _ in range(min(max_tokens, self.config["max_seq"] - len(prompt_ids))):
                async with self.step_lock:
                    version = self.version
                    token, logprob = await asyncio.to_thread(self._sample, ids, temperature, gen)
                ids.append(token)
                piece = self.tokenizer.token(token)
                text += piece
                yield GeneratedToken(token, piece, logprob, version)
                if token == self.tokenizer.eos_id or (stop and any(s and text.endswith(s) for s in stop)):
                    return
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()


# ---------------------------------------------------------------------------
# OpenAI-compatible HTTP server
# ---------------------------------------------------------------------------


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


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def build_app(engine: ReferenceEngine):
    """The aiohttp application: OpenAI completions/chat (with SSE), health, models, admin."""
    from aiohttp import web

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
    _runner: Any

    async def stop(self) -> None:
        await self._runner.cleanup()


async def serve_engine(engine: ReferenceEngine, host: str = "127.0.0.1", port: int = 0) -> RunningEngineServer:
    """Start the OpenAI-compatible server on ``host:port`` (0 picks a free port)."""
    from aiohttp import web

    runner = web.AppRunner(build_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return RunningEngineServer(engine, f"http://{host}:{bound}", runner)


def main(argv: list[str] | None = None) -> None:
    """``python -m weftboard.subscriber.reference_model --listen 127.0.0.1:8001``: an engine of its own."""
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
