"""The reference engine: serves the reference model's bf16 weights, one token per step.

It exists so that tests, ``weftboard sidecar --engine reference`` and the demo exercise a
real engine end to end on a CPU: real weights that the subscriber patches in place, real
sampling with log-probs, real streaming. It is not meant to be good at language.

Invariants:
- The served weights are the bf16 tensors in ``ReferenceEngine.tensors``; they are only
  ever modified in place (``copy_``/patch apply), so their storage never moves and a
  holder of a reference (the subscriber's live-tensor destination) always sees them.
- A decoding step holds ``step_lock``; a weight change holds it too (``pause``), so one
  token is always computed from one version's weights (never a mix); each generated token
  carries the version it was computed with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from weftboard.proto.errors import ApplyError, InvalidArgument
from weftboard.subscriber.reference_engine.model import (
    CharTokenizer,
    forward,
    init_parameters,
    model_config,
)


@dataclass
class GeneratedToken:
    token_id: int
    text: str
    logprob: float
    version: int


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
