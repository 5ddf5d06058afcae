"""Helpers for publisher/subscriber tests: a small real model trained with real AdamW steps.

The trainer keeps, for every version it publishes, the served view it expects islands to
reach (the bf16 projection of its weights at that publish), so tests compare islands
bitwise against an independent record of the truth.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

# ``pytestmark`` of a module whose tests publish or follow runs: the session's kernel warm-up
# (conftest's ``warm_kernels``) before its first test, and a time limit with room for that
# warm-up on an empty cache (about three minutes on a two-core host).
WARM_KERNELS = [pytest.mark.usefixtures("warm_kernels"), pytest.mark.timeout(600)]


class TinyBlock(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """A 2-layer transformer-shaped LM (about 1M parameters at the defaults)."""

    def __init__(self, vocab: int = 512, d: int = 128, hidden: int = 512, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(TinyBlock(d, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))


class Trainer:
    """Real AdamW steps on random-token data; ``served()`` is the bf16 view to compare with."""

    def __init__(self, lr: float = 1e-4, seed: int = 0, **model_kw) -> None:
        self.model = TinyLM(seed=seed, **model_kw)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.vocab = self.model.lm_head.out_features
        self.step_no = 0

    def step(self) -> None:
        tokens = torch.randint(0, self.vocab, (4, 16), generator=self.gen)
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.step_no += 1

    def served(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16).clone() for k, v in self.model.state_dict().items()}


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if set(a) != set(b):
        return False
    return all(
        a[n].shape == b[n].shape and a[n].dtype == b[n].dtype
        and torch.equal(a[n].contiguous().view(torch.uint8), b[n].contiguous().view(torch.uint8))
        for n in a
    )


def first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    for n in sorted(set(a) | set(b)):
        if n not in a or n not in b:
            return f"{n}: present on one side only"
        x, y = a[n].contiguous().view(torch.uint8), b[n].contiguous().view(torch.uint8)
        if x.shape != y.shape or not torch.equal(x, y):
            return f"{n}: bytes differ"
    return "none"


def zeros_like_layout(view: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in view.items()}


async def follow_each(client: Any, run: str, store: Any, tmp: Path, views: dict[int, dict], *,
                      presigned: bool = False) -> None:
    """A subscriber steps through every version up to the head and must match ``views`` (the
    expected served view by version) bitwise at each; ``presigned``: blobs through the
    board's presigned URLs instead of ``store``."""
    from weftboard.subscriber.live_tensors import LiveTensorsDestination
    from weftboard.subscriber.subscriber import Subscriber

    head = (await client.get_head(run)).version
    dest = LiveTensorsDestination(zeros_like_layout(views[head]))
    sub = Subscriber(client, run, dest, island_id="checker", blob_store=None if presigned else store,
                     cache_dir=tmp / "checker-cache", heartbeat=False)
    for v in range(1, head + 1):
        assert await sub.sync_to(v) == v
        assert bits_equal(dest.tensors, views[v]), f"version {v}: {first_difference(dest.tensors, views[v])}"


async def island_and_trainer_tokens(address: str, admin_token: str) -> tuple[str, str]:
    """An ISLAND-role and a PUBLISHER-role token made by the board's admin."""
    from weftboard.board.client import BoardClient
    from weftboard.proto.v1 import board_pb2 as pb

    async with BoardClient(address, admin_token) as admin:
        island = (await admin.create_token("islands", pb.ROLE_ISLAND)).token
        trainer = (await admin.create_token("trainer", pb.ROLE_PUBLISHER)).token
    return island, trainer


async def run_cli(*args: str, timeout_s: float = 90) -> tuple[int, str]:
    """``weftboard ARGS`` in a process of its own: its exit status and what it wrote to stderr."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "weftboard.board.cli", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, err.decode()
