"""``weftboard demo``: a complete small RL loop on one machine, every part real.

- Services: a bundled ``redis-server`` and a local-directory blob store (or SeaweedFS S3
  with ``--s3``), and a board (gRPC) on loopback.
- Trainer: the reference model in fp32 master weights, REINFORCE with a batch baseline
  and truncated importance weights, real AdamW steps; every step is published as a
  version through the Publisher (bf16 served view, lossless patches, periodic anchors).
- Islands: two sidecars with in-process reference engines that the subscriber patches in
  place; the second joins late, from the nearest anchor, and enters rotation only when
  its ``/health/ready`` says so.
- Rollouts: HTTP completions to the ready sidecars with ``X-Weftboard-Version:
  max_staleness=1``; the sidecars report each request's metadata to the board's
  trajectory stream; the trainer consumes it (``TrajectoryConsumer``), joins it with the
  completions by request id, and trains on it: the behaviour log-probs in the records
  are the denominators of the importance weights.
- Toy task: after the prompt ``say ab:`` the model should write ``abababab``; the reward
  is the fraction of positions right (partial credit for the wrong one of a/b).

Invariants: everything started here is stopped on the way out (also on errors and
Ctrl-C); at the end every island is checked bitwise against the trainer's served view.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
import uuid
from contextlib import AsyncExitStack, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch
from rich.console import Console

from weftboard.board.blobs import LocalDirBlobStore, S3BlobStore
from weftboard.board.client import BoardClient
from weftboard.board.embedded import start_redis, start_seaweedfs
from weftboard.board.logs import configure
from weftboard.board.process import BoardConfig, start_board
from weftboard.cuda.warmup import warm_up_kernels
from weftboard.publisher.publisher import Publisher
from weftboard.publisher.trajectories import TrajectoryConsumer
from weftboard.subscriber.demo.view import (
    DemoStep,
    DemoView,
    IslandRow,
    VersionRow,
    plot,
    summary_table,
)
from weftboard.subscriber.engine_island import REFERENCE_CONFIG_LABEL, start_island
from weftboard.subscriber.reference_engine.model import (
    CharTokenizer,
    init_parameters,
    model_config,
    sequence_logprobs,
)

RUN = "demo"
PROMPT = "say ab:"
TARGET = "ab"
DEMO_MODEL = {"name": "weftboard-reference", "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "max_seq": 32}


@dataclass
class DemoConfig:
    steps: int = 30
    out: Path = Path("weftboard-demo")
    seed: int = 0
    s3: bool = False
    rollouts: int = 16
    live: bool | None = None
    lr: float = 1e-3
    max_tokens: int = 8
    late_join_step: int | None = None  # default: a third of the way in
    anchor_every: int = 10
    max_staleness: int = 1
    model: dict[str, Any] = field(default_factory=lambda: dict(DEMO_MODEL))


@dataclass
class DemoResult:
    ok: bool
    head: int
    steps: list[DemoStep]
    versions: list[VersionRow]
    islands: dict[str, int]
    bitwise: dict[str, bool]
    plot_path: Path
    summary_path: Path
    started: list[str]


def reward_of(text: str, length: int) -> float:
    """Fraction of the ``length`` positions holding the target pattern's character."""
    score = 0.0
    for i, ch in enumerate(text[:length]):
        score += 1.0 if ch == TARGET[i % len(TARGET)] else (0.2 if ch in TARGET else 0.0)
    return score / length


class Trainer:
    """fp32 master weights of the reference model and an AdamW optimizer over them."""

    def __init__(self, config: dict[str, Any], lr: float) -> None:
        self.config = model_config(config)
        self.tokenizer = CharTokenizer()
        self.params = {k: v.clone().requires_grad_() for k, v in init_parameters(self.config).items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=0.0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.params.items()}

    def served_view(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16) for k, v in self.params.items()}

    def step(self, samples: list[tuple[str, bool, float, float]]) -> float:
        """One policy-gradient step on (completion, stopped, reward, behaviour log-prob sum)."""
        prompt_ids = self.tokenizer.encode(PROMPT)
        rewards = torch.tensor([s[2] for s in samples])
        advantages = rewards - rewards.mean()
        loss = torch.zeros(())
        for (text, stopped, _, behaviour_lp), adv in zip(samples, advantages, strict=True):
            ids = self.tokenizer.encode(text) + ([self.tokenizer.eos_id] if stopped else [])
            if not ids:
                continue
            lp = sequence_logprobs(self.params, prompt_ids, ids, self.config).sum()
            ratio = torch.exp(lp.detach() - behaviour_lp).clamp(max=2.0)  # truncated importance weight
            loss = loss - ratio * adv * lp
        loss = loss / max(len(samples), 1)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())


async def _ready(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _rollout(session: aiohttp.ClientSession, url: str, step: int, seed: int, cfg: DemoConfig,
                   attempts: int = 5) -> tuple[str, dict] | None:
    """One completion through a sidecar; retries a 409 after its Retry-After."""
    request_id = f"s{step}-{uuid.uuid4().hex[:12]}"
    body = {"model": "weftboard-reference", "prompt": PROMPT, "max_tokens": cfg.max_tokens, "temperature": 1.0,
            "seed": seed, "logprobs": 1}
    headers = {"X-Weftboard-Version": f"max_staleness={cfg.max_staleness}", "X-Request-Id": request_id,
               "X-Weftboard-Labels": f"step={step},task=ab", "X-Weftboard-Deadline-Ms": "5000"}
    for _ in range(attempts):
        async with session.post(url + "/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=30)) as r:
            payload = await r.json()
            if r.status == 200:
                return request_id, payload
            if r.status == 409:
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            raise RuntimeError(f"sidecar {url} answered {r.status}: {payload}")
    return None


async def run_demo(cfg: DemoConfig, console: Console | None = None) -> DemoResult:
    console = console or Console()
    configure(json=False, level="WARNING")
    out = cfg.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    late_join = cfg.late_join_step if cfg.late_join_step is not None else max(1, cfg.steps // 3)
    started: list[str] = []

    console.print("[bold]preparing[/bold] the patch codec (its CPU kernels compile on a machine's first run only)")
    warm = await asyncio.to_thread(warm_up_kernels, ("bf16",), ("default",))
    console.print(f"[bold]ready[/bold] codec warm in {warm.seconds:.1f}s ({len(warm.signatures)} kernel signatures "
                  "compiled or loaded)")

    async with AsyncExitStack() as stack:
        redis = await asyncio.to_thread(start_redis, out / "redis")
        stack.callback(redis.stop)
        started.append(f"redis-server (bundled) at {redis.url}, data in {redis.dir}")
        if cfg.s3:
            weed = await asyncio.to_thread(start_seaweedfs, out / "seaweedfs")
            stack.callback(weed.stop)
            store: Any = S3BlobStore(weed.endpoint, weed.access_key or "", weed.secret_key or "", weed.bucket or "",
                                     region="us-east-1", prefix="demo/")
            started.append(f"SeaweedFS S3 server at {weed.url}, bucket {weed.bucket}")
        else:
            store = LocalDirBlobStore(out / "blobs")
            started.append(f"local-directory blob store at {out / 'blobs'}")
        stack.push_async_callback(store.close)
        token = "demo-admin-" + secrets.token_hex(8)
        board = await start_board(BoardConfig(listen="127.0.0.1:0", redis_url=redis.url, admin_token=token,
                                              watch_progress_s=0.5), blobs=store)
        stack.push_async_callback(board.stop)
        started.append(f"board (gRPC) at {board.address}")
        for line in started:
            console.print(f"[bold]started[/bold] {line}")

        trainer = Trainer({**cfg.model, "seed": cfg.seed}, cfg.lr)
        publisher = Publisher(board.address, RUN, token=token, blob_store=store, anchor_every=cfg.anchor_every,
                              work_dir=out / "publisher",
                              run_labels={REFERENCE_CONFIG_LABEL: json.dumps(trainer.config)})
        stack.callback(publisher.close, False)
        publish_at: dict[int, float] = {}

        def publish(step: int) -> int:
            t0 = time.time()
            handle = publisher.publish(trainer.state_dict(), step=step, labels={"task": "ab"})
            publish_at[handle.version] = t0
            return handle.version

        version = await asyncio.to_thread(publish, 0)

        islands: dict[str, Any] = {}

        async def add_island(name: str, mode: str) -> None:
            islands[name] = await start_island(
                board=board.address, token=token, run=RUN, island_id=name, engine="reference",
                reference_config=trainer.config, cache_dir=out / "islands" / name / "cache", mode=mode,
                blob_store=store, heartbeat_s=1.0, default_deadline_s=5.0)
            stack.push_async_callback(islands[name].stop)
            console.print(f"[bold]started[/bold] island {name} (sidecar {islands[name].url}, activation {mode})")

        await add_island("island-a", "in_place")

        client = BoardClient(board.address, token)
        stack.push_async_callback(client.close)
        consumer = TrajectoryConsumer(client, RUN, group="trainer", consumer="trainer-0",
                                      max_staleness=cfg.max_staleness, block_ms=200)
        session = aiohttp.ClientSession()
        stack.push_async_callback(session.close)

        steps: list[DemoStep] = []
        rng = torch.Generator().manual_seed(cfg.seed)

        def island_rows() -> list[IslandRow]:
            head = publisher.head
            rows = []
            for name, isl in islands.items():
                state = "error" if isl.state.error else "ready" if isl.state.ready else "catching up"
                rows.append(IslandRow(name, isl.state.held, max(head - isl.state.held, 0), state,
                                      isl.sidecar.served, isl.sidecar.rejected))
            return rows

        with DemoView(cfg.live, cfg.steps, console) as view:
            # The first island must serve version 1 before the first rollouts.
            await islands["island-a"].subscriber.wait_for_version(1, timeout_s=60)
            for step in range(1, cfg.steps + 1):
                t_step = time.monotonic()
                if step == late_join:
                    await add_island("island-b", "drain")
                ready = [isl.url for isl in islands.values() if await _ready(session, isl.url)]
                while not ready:
                    await asyncio.sleep(0.1)
                    ready = [isl.url for isl in islands.values() if await _ready(session, isl.url)]
                seeds = torch.randint(0, 2**31 - 1, (cfg.rollouts,), generator=rng).tolist()
                results = await asyncio.gather(*(
                    _rollout(session, ready[i % len(ready)], step, seeds[i], cfg) for i in range(cfg.rollouts)))
                completions = {rid: payload for rid, payload in filter(None, results)}
                # Trajectory metadata comes back through the board; join it with the completions.
                records = {}
                deadline = time.monotonic() + 10.0
                while len(records) < len(completions) and time.monotonic() < deadline:
                    batch = await consumer.poll()
                    await consumer.ack(batch)
                    records.update({t.request_id: t for t in batch if t.request_id in completions})
                samples = []
                for rid, t in records.items():
                    choice = completions[rid]["choices"][0]
                    text = choice["text"]
                    samples.append((text, choice["finish_reason"] == "stop", reward_of(text, cfg.max_tokens),
                                    t.record.logprob_sum))
                if samples:
                    await asyncio.to_thread(trainer.step, samples)
                version = await asyncio.to_thread(publish, step)
                mean_reward = sum(s[2] for s in samples) / len(samples) if samples else float("nan")
                steps.append(DemoStep(step, version - 1, mean_reward, cfg.rollouts, len(samples),
                                      max((t.staleness for t in records.values()), default=0),
                                      time.monotonic() - t_step, samples[0][0] if samples else ""))
                view.update(publisher.head, steps, island_rows(), _version_rows(publisher, islands, publish_at))

            # Let every island reach the head, then check it bitwise against the trainer.
            await asyncio.to_thread(publisher.flush, 120)
            head = publisher.head
            for isl in islands.values():
                with suppress(TimeoutError):
                    await isl.subscriber.wait_for_version(head, timeout_s=60)
            view.update(head, steps, island_rows(), _version_rows(publisher, islands, publish_at))

        served = trainer.served_view()
        bitwise = {name: isl.state.held == head and all(
            torch.equal(isl.engine.tensors[k].view(torch.int16), served[k].view(torch.int16)) for k in served)
            for name, isl in islands.items()}
        versions = _version_rows(publisher, islands, publish_at)
        plot_path = plot(steps, versions, list(islands), out / "demo.png")
        summary_path = out / "summary.json"
        summary_path.write_text(json.dumps({
            "head": head, "islands": {n: i.state.held for n, i in islands.items()}, "bitwise": bitwise,
            "steps": [asdict(s) for s in steps], "versions": [asdict(v) for v in versions], "started": started,
        }, indent=2, default=str))
        console.print(summary_table(steps, versions, list(islands)))
        first = [s.reward for s in steps[:3] if not math.isnan(s.reward)]
        last = [s.reward for s in steps[-3:] if not math.isnan(s.reward)]
        if first and last:
            console.print(f"reward: {sum(first) / len(first):.3f} (first steps) -> {sum(last) / len(last):.3f} (last steps)")
        for name, ok in bitwise.items():
            console.print(f"{name}: v{islands[name].state.held} of head v{head}, bitwise equal to the trainer: {ok}")
        console.print(f"plot: {plot_path}")
        console.print(f"summary: {summary_path}")
        return DemoResult(all(bitwise.values()), head, steps, versions,
                          {n: i.state.held for n, i in islands.items()}, bitwise, plot_path, summary_path, started)


def _version_rows(publisher: Any, islands: dict[str, Any], publish_at: dict[int, float]) -> list[VersionRow]:
    rows = []
    for record in list(publisher.committed):
        s = record.stats
        sync = {}
        for name, isl in islands.items():
            applied = isl.subscriber.applied_at.get(record.version)
            if applied is not None and record.version in publish_at:
                sync[name] = max(applied - publish_at[record.version], 0.0)
        rows.append(VersionRow(record.version, s.patch_bytes, s.anchor_bytes, s.density, s.changed_elements, sync))
    return rows
