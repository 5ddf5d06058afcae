"""The reference engine: a real tiny LM behind a real OpenAI-compatible HTTP server."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest
import torch
from safetensors.torch import save_file

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.engines.base import ActivationMode
from weftboard.subscriber.engines.factory import make_adapter
from weftboard.subscriber.reference_engine.engine import ReferenceEngine
from weftboard.subscriber.reference_engine.model import (
    init_parameters,
    model_config,
    sequence_logprobs,
)
from weftboard.subscriber.reference_engine.openai_api import serve_engine

SMALL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq": 64}


@pytest.fixture
async def server():
    engine = ReferenceEngine(SMALL)
    running = await serve_engine(engine)
    yield running
    await running.stop()


async def post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.json()


async def sse_events(url: str, body: dict) -> list:
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_init_is_deterministic_and_bf16_view_differs_from_fp32():
    cfg = model_config(SMALL)
    a, b = init_parameters(cfg), init_parameters(cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = init_parameters(model_config({**SMALL, "seed": 1}))
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


async def test_completion_logprobs_match_the_model(server):
    status, body = await post(server.url + "/v1/completions",
                              {"prompt": "abc", "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 1})
    assert status == 200
    choice = body["choices"][0]
    lps = choice["logprobs"]["token_logprobs"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": len(lps), "total_tokens": 3 + len(lps)}
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"] or choice["finish_reason"] == "stop"
    # The served log-probs are the model's: recompute them from the bf16 weights.
    engine = server.engine
    ids = engine.tokenizer.encode(choice["text"])
    if choice["finish_reason"] == "stop":
        ids = ids + [engine.tokenizer.eos_id]
    recomputed = sequence_logprobs(engine.tensors, engine.tokenizer.encode("abc"), ids, engine.config)
    assert recomputed.tolist() == pytest.approx(lps, abs=1e-4)
    assert all(lp <= 0 for lp in lps)


async def test_same_seed_same_text_and_greedy(server):
    body = {"prompt": "hello", "max_tokens": 10, "seed": 11}
    _, a = await post(server.url + "/v1/completions", body)
    _, b = await post(server.url + "/v1/completions", body)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


async def test_chat_completion_and_stream(server):
    status, body = await post(server.url + "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "logprobs": True,
                               "seed": 1})
    assert status == 200 and body["object"] == "chat.completion"
    assert len(body["choices"][0]["logprobs"]["content"]) == body["usage"]["completion_tokens"]
    events = await sse_events(server.url + "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
                               "seed": 1})
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == body["choices"][0]["message"]["content"]
    assert events[-2]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]


async def test_bad_requests_are_400(server):
    status, body = await post(server.url + "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    status, _ = await post(server.url + "/v1/chat/completions", {"messages": []})
    assert status == 400


async def test_models_and_health(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "weftboard-reference"
        async with s.get(server.url + "/health") as r:
            assert r.status == 200


async def test_in_place_pause_changes_weights_between_tokens():
    engine = ReferenceEngine(SMALL, token_delay_s=0.02)
    adapter = make_adapter("reference", engine=engine)
    new = {k: (v.float() * 1.5).to(torch.bfloat16) for k, v in engine.tensors.items()}
    versions = []

    async def consume():
        async for tok in engine.generate("ab", max_tokens=12, temperature=1.0, seed=0):
            versions.append(tok.version)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.08)
    await adapter.pause(ActivationMode.IN_PLACE)
    engine.copy_weights_(new)
    adapter.mark_served(1)
    await adapter.resume()
    await task
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)


async def test_drain_pause_waits_for_running_generations():
    engine = ReferenceEngine(SMALL, token_delay_s=0.01)
    seen = []

    async def consume():
        async for tok in engine.generate("ab", max_tokens=6, seed=0):
            seen.append(tok)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.02)
    await engine.pause("drain")
    assert task.done() and len(seen) >= 1
    await engine.resume()


async def test_http_adapter_loads_a_checkpoint_and_rejects_a_bad_one(tmp_path):
    engine = ReferenceEngine(SMALL)
    running = await serve_engine(engine)
    adapter = make_adapter("reference", running.url, timeout_s=10)
    try:
        target = init_parameters(model_config({**SMALL, "seed": 5}), torch.bfloat16)
        good = tmp_path / "good"
        good.mkdir()
        save_file(target, str(good / "model.safetensors"))
        await adapter.pause(ActivationMode.DRAIN)
        await adapter.load_checkpoint(good, 2)
        await adapter.resume()
        assert adapter.served_version() == 2 and engine.version == 2
        assert all(torch.equal(engine.tensors[k], target[k]) for k in target)

        bad = tmp_path / "bad"
        bad.mkdir()
        broken = dict(target)
        broken.pop("lm_head.weight")
        broken["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
        save_file(broken, str(bad / "model.safetensors"))
        await adapter.pause(ActivationMode.DRAIN)
        with pytest.raises(ApplyError, match="500"):
            await adapter.load_checkpoint(bad, 3)
        await adapter.resume()
        assert adapter.served_version() == 2 and engine.version == 2
        assert all(torch.equal(engine.tensors[k], target[k]) for k in target)  # no partial load
    finally:
        await adapter.close()
        await running.stop()


def test_training_gradient_flows_through_fp32_params():
    cfg = model_config(SMALL)
    params = {k: v.requires_grad_() for k, v in init_parameters(cfg).items()}
    lp = sequence_logprobs(params, [1, 2, 3], [4, 5], cfg)
    lp.sum().backward()
    assert math.isfinite(float(lp.sum().detach()))
    assert params["lm_head.weight"].grad is not None and params["lm_head.weight"].grad.abs().sum() > 0
