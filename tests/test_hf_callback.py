"""``WeftboardCallback`` in real Hugging Face training: a ``transformers.Trainer`` and TRL's
``GRPOTrainer`` (generating with the policy itself) train a tiny random causal LM on CPU and
publish to a real board; an island follows every version bitwise against the weights the
trainer held at each publish (cast to the served bf16), and ends with a model folder that
transformers loads (config naming the architecture and bf16, the tokenizer). A sharded job
(2 ranks, FSDP2 ``fully_shard`` on gloo) publishes through the same callback.

Real board, Redis and blob store (tests/conftest.py); training runs in a thread beside the
board's event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import trl
from datasets import Dataset
from distkit import run_ranks
from pubsubkit import WARM_KERNELS, bits_equal, first_difference, follow_each
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
)

from weftboard.board.blobs.localdir import LocalDirBlobStore
from weftboard.board.client import BoardClient
from weftboard.board.embedded import free_port
from weftboard.proto.errors import InvalidArgument
from weftboard.publisher import WeftboardCallback
from weftboard.publisher.hf_callback import VERSION_LOG_KEY
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.subscriber import Subscriber

pytestmark = WARM_KERNELS

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "one two three four five", "hello world again",
         "green trees and blue sky", "numbers like 1 2 3 and 4"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on TEXTS, as a transformers fast tokenizer."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def tiny_llama(tok: PreTrainedTokenizerFast, *, tied: bool = False, qwen: bool = False) -> torch.nn.Module:
    kw = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**kw)) if qwen else LlamaForCausalLM(LlamaConfig(**kw))


def served(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    """What islands must hold: every weight in bf16; a tied lm_head only as the embedding."""
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()
            if not (tied and n == "lm_head.weight")}


class Recorder(TrainerCallback):
    """After the weftboard callback: the served view of every version it published."""

    def __init__(self, weft: WeftboardCallback, tied: bool) -> None:
        self.weft, self.tied = weft, tied
        self.views: dict[int, dict[str, torch.Tensor]] = {}

    def _record(self, state: Any, model: torch.nn.Module) -> None:
        version = self.weft.versions.get(state.global_step)
        if version is not None and version not in self.views:
            self.views[version] = served(model, self.tied)

    def on_train_begin(self, args, state, control, model=None, **kw) -> None:
        self._record(state, model)

    def on_step_end(self, args, state, control, model=None, **kw) -> None:
        self._record(state, model)

    def on_train_end(self, args, state, control, model=None, **kw) -> None:
        self._record(state, model)


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kw) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def common_args(out: Path, steps: int) -> dict[str, Any]:
    return dict(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="no", max_steps=steps, logging_steps=1,
                learning_rate=1e-2, disable_tqdm=True, seed=0)


def lm_trainer(model, tok, out: Path, steps: int, callbacks: list) -> Trainer:
    data = Dataset.from_dict(dict(tok(TEXTS * 4, truncation=True, max_length=16)))
    return Trainer(model=model, args=TrainingArguments(per_device_train_batch_size=4, **common_args(out, steps)),
                   train_dataset=data, processing_class=tok, callbacks=callbacks,
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False))


async def check_island(client: BoardClient, run: str, store, root: Path, tok, final: dict[str, torch.Tensor],
                       architecture: str) -> None:
    """An island on the run's head: a folder transformers loads, holding the final weights."""
    head = (await client.get_head(run)).version
    dest = await asyncio.to_thread(CheckpointDirDestination, root)
    sub = Subscriber(client, run, dest, island_id="folder", blob_store=store, cache_dir=root / "cache", heartbeat=False)
    assert await sub.sync_to(head) == head
    folder = dest.current.resolve()
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names, names
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    saved = root / "saved-tokenizer"
    tok.save_pretrained(saved)
    assert (folder / "tokenizer.json").read_bytes() == (saved / "tokenizer.json").read_bytes()

    def load() -> tuple[dict[str, torch.Tensor], list[int]]:
        model = AutoModelForCausalLM.from_pretrained(folder)
        return model.state_dict(), AutoTokenizer.from_pretrained(folder)("the cat sat")["input_ids"]

    loaded, ids = await asyncio.to_thread(load)
    assert ids == tok("the cat sat")["input_ids"]
    assert loaded.keys() >= final.keys()
    got = {n: loaded[n].to(torch.bfloat16) for n in final}  # bf16 -> the loader's dtype -> bf16 is exact
    assert bits_equal(got, final), first_difference(got, final)


async def test_trainer_publishes_every_n_steps_and_an_island_follows_bitwise(board, local_store, tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    model = tiny_llama(tok)
    weft = WeftboardCallback(board.address, "lm", token=board.admin_token, every_n_steps=2, blob_store=local_store)
    recorder = Recorder(weft, tied=False)
    trainer = lm_trainer(model, tok, tmp_path / "out", 5, [weft, recorder])
    await asyncio.to_thread(trainer.train)

    # steps 0 (the initial weights), 2, 4 and 5 (the last)
    assert weft.versions == {0: 1, 2: 2, 4: 3, 5: 4}
    assert weft.last_record is not None and (weft.last_record.version, weft.last_record.step) == (4, 5)
    assert weft.publisher is None  # closed at train end
    logged = [(h["step"], h.get(VERSION_LOG_KEY)) for h in trainer.state.log_history]
    assert logged == [(1, 1), (2, 2), (3, 2), (4, 3), (5, 4), (5, 4)]  # 5 steps, then the summary
    assert sorted(recorder.views) == [1, 2, 3, 4]
    assert not bits_equal(recorder.views[1], recorder.views[4])  # training changed the weights
    async with BoardClient(board.address, board.admin_token) as client:
        assert (await client.get_head("lm")).version == 4
        assert [(await client.get_version("lm", v)).step for v in (1, 2, 3, 4)] == [0, 2, 4, 5]
        await follow_each(client, "lm", local_store, tmp_path, recorder.views)
        await check_island(client, "lm", local_store, tmp_path / "island", tok, served(model, tied=False),
                           "LlamaForCausalLM")


async def test_grpo_trainer_publishes_each_step_and_an_island_follows_bitwise(board, local_store, tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    model = tiny_llama(tok, tied=True, qwen=True)
    weft = WeftboardCallback(board.address, "grpo", token=board.admin_token, blob_store=local_store)
    recorder = Recorder(weft, tied=True)

    def longer_is_better(completions: list[str], **kw: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    prompts = Dataset.from_dict({"prompt": ["the cat", "a dog", "one two", "hello", "green", "numbers"]})
    args = trl.GRPOConfig(per_device_train_batch_size=2, num_generations=2, max_completion_length=6,
                          **common_args(tmp_path / "out", 3))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=longer_is_better, args=args, train_dataset=prompts,
                              processing_class=tok, callbacks=[weft, recorder])
    await asyncio.to_thread(trainer.train)

    assert weft.versions == {0: 1, 1: 2, 2: 3, 3: 4}
    logged = [(h["step"], h.get(VERSION_LOG_KEY)) for h in trainer.state.log_history]
    assert logged == [(1, 2), (2, 3), (3, 4), (3, 4)]
    assert not bits_equal(recorder.views[1], recorder.views[4])
    async with BoardClient(board.address, board.admin_token) as client:
        run = await client.get_run("grpo")
        assert "lm_head.weight" not in {t.name for t in run.layout.tensors}  # tied: published once
        await follow_each(client, "grpo", local_store, tmp_path, recorder.views)
        await check_island(client, "grpo", local_store, tmp_path / "island", tok, served(model, tied=True),
                           "Qwen2ForCausalLM")


async def test_a_stopped_training_publishes_its_last_step_at_train_end(board, local_store, tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    model = tiny_llama(tok)
    weft = WeftboardCallback(board.address, "stop", token=board.admin_token, every_n_steps=10, publish_initial=False,
                             blob_store=local_store, model_files=())
    recorder = Recorder(weft, tied=False)
    trainer = lm_trainer(model, tok, tmp_path / "out", 20, [StopAt(3), weft, recorder])
    await asyncio.to_thread(trainer.train)

    assert weft.versions == {3: 1}  # nothing was due before the stop
    history = trainer.state.log_history
    assert [h.get(VERSION_LOG_KEY) for h in history[:-1]] == [None] * 4  # steps 1-3 and the summary
    assert history[-1] == {VERSION_LOG_KEY: 1, "step": 3}
    async with BoardClient(board.address, board.admin_token) as client:
        assert not (await client.get_run("stop")).model_files  # model_files=(): none
        await follow_each(client, "stop", local_store, tmp_path, recorder.views)


async def test_a_peft_lora_model_publishes_its_merged_weights_as_the_base_model(board, local_store,
                                                                                tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    tok = tiny_tokenizer()
    model = peft.get_peft_model(tiny_llama(tok), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    weft = WeftboardCallback(board.address, "lora", token=board.admin_token, blob_store=local_store)
    trainer = lm_trainer(model, tok, tmp_path / "out", 3, [weft])
    await asyncio.to_thread(trainer.train)

    assert weft.versions == {0: 1, 1: 2, 2: 3, 3: 4}
    assert any("lora_A" in n for n in model.state_dict())  # the training model keeps its adapters
    merged = served(model.merge_and_unload(), tied=False)
    async with BoardClient(board.address, board.admin_token) as client:
        names = [t.name for t in (await client.get_run("lora")).layout.tensors]
        assert names == list(merged)  # the base model's names: no base_model.model., base_layer or lora_*
        await check_island(client, "lora", local_store, tmp_path / "island", tok, merged, "LlamaForCausalLM")


def test_bad_arguments_are_refused_clearly() -> None:
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidArgument, match="every_n_steps must be an integer >= 1"):
            WeftboardCallback("127.0.0.1:1", "r", every_n_steps=bad)
    for board in ("", "  ", None):
        with pytest.raises(InvalidArgument, match="needs the board's address"):
            WeftboardCallback(board, "r")
    with pytest.raises(InvalidArgument, match="run"):
        WeftboardCallback("127.0.0.1:1", "no/slashes here")
    with pytest.raises(InvalidArgument, match=r"unknown publisher options \['anchor_evry'\]"):
        WeftboardCallback("127.0.0.1:1", "r", anchor_evry=5)
    with pytest.raises(InvalidArgument, match="ServedFormatSpec"):
        WeftboardCallback("127.0.0.1:1", "r", served_format="bf16")


def test_the_publisher_package_never_imports_transformers_itself() -> None:
    probe = (
        "import sys\n"
        "import weftboard.publisher as p\n"
        "assert 'transformers' not in sys.modules, 'imported transformers'\n"
        "assert p.ShardedPublisher and 'WeftboardCallback' not in p.__all__\n"
        "sys.modules['transformers'] = None  # as if it were not installed\n"
        "try:\n"
        "    p.WeftboardCallback\n"
        "except ImportError as exc:\n"
        "    print('refused:', exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused: import of transformers halted" in result.stdout, result.stdout


# -- a sharded job: every rank publishes through the callback ----------------------------------


def _sharded_rank(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """One rank: a tiny Llama under FSDP2, AdamW steps, the callback's hooks at each step."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415  (child process only)
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = Path(cfg["out"])
    tok = tiny_tokenizer()
    model = tiny_llama(tok)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weft = WeftboardCallback(cfg["board"], "fsdp", token=cfg["token"], blob_store=LocalDirBlobStore(cfg["blobs"]),
                             collective_timeout_s=60)
    state = TrainerState(max_steps=cfg["steps"], is_world_process_zero=rank == 0)
    report: dict[str, Any] = {"error": None}
    try:
        weft.on_train_begin(None, state, None, model=model, processing_class=tok)
        views = {1: {n: t.full_tensor().to(torch.bfloat16) for n, t in model.state_dict().items()}}
        gen = torch.Generator().manual_seed(rank)
        for step in range(1, cfg["steps"] + 1):
            ids = torch.randint(0, len(tok), (2, 8), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            state.global_step = step
            weft.on_step_end(None, state, None, model=model)
            views[weft.versions[step]] = {n: t.full_tensor().to(torch.bfloat16) for n, t in model.state_dict().items()}
        weft.on_train_end(None, state, None, model=model)
        report.update(versions=weft.versions, last=weft.last_record.version)
        if rank == 0:
            torch.save(views, out / "views.pt")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(exc).__name__}: {exc}"
    (out / f"report-{rank}.json").write_text(json.dumps(report))
    if report["error"] is None:
        dist.destroy_process_group()
    os._exit(0)  # a failed peer can hang the process group's teardown


async def test_a_sharded_job_publishes_through_the_callback_on_every_rank(board, local_store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cfg = {"board": board.address, "token": board.admin_token, "blobs": str(local_store.root), "out": str(out),
           "steps": 2, "port": free_port()}

    def spawn() -> list[int | None]:
        return run_ranks(_sharded_rank, 2, (2, cfg), deadline_s=150)

    assert await asyncio.to_thread(spawn) == [0, 0]
    reports = [json.loads((out / f"report-{r}.json").read_text()) for r in range(2)]
    assert reports == [{"error": None, "versions": {"0": 1, "1": 2, "2": 3}, "last": 3}] * 2, reports
    views = torch.load(out / "views.pt")
    async with BoardClient(board.address, board.admin_token) as client:
        await follow_each(client, "fsdp", local_store, tmp_path, views)
        await check_island(client, "fsdp", local_store, tmp_path / "island", tiny_tokenizer(), views[3],
                           "LlamaForCausalLM")
