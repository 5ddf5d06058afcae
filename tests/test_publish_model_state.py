"""What a publisher reads from a model (``publisher/model_state.py``) and how it ends when it
is not closed: wrappers (``torch.compile``, DDP, DataParallel) removed, tied weights once,
PEFT adapters merged under the base model's names (a hand-built LoRA layer with peft's
interface, and peft itself where installed) without touching the training model; a publisher
left open is closed by its finalizer (garbage, interpreter exit); a publish waiting on a slot
says so; the callback closes the publisher when ``on_train_begin`` fails after opening it.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import torch.distributed as dist
from pubsubkit import WARM_KERNELS, Trainer
from torch import nn

from weftboard.proto.errors import InvalidArgument
from weftboard.publisher.publisher import Publisher
from weftboard.publisher.served_view import master_state

pytestmark = WARM_KERNELS


class Tiny(nn.Module):
    """Embedding, two projections and an optionally tied head."""

    def __init__(self, tied: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8, dtype=dtype)
        self.q_proj = nn.Linear(8, 8, dtype=dtype)
        self.v_proj = nn.Linear(8, 8, bias=False, dtype=dtype)
        self.head = nn.Linear(8, 16, bias=False, dtype=dtype)
        if tied:
            self.head.weight = self.embed.weight


def _names(state: dict[str, Any]) -> list[str]:
    return list(state)


# -- wrappers and tied weights -----------------------------------------------------------------


def test_compiled_and_data_parallel_models_publish_the_models_own_names(tmp_path: Path) -> None:
    model = Tiny()
    plain = list(model.state_dict())
    assert _names(master_state(torch.compile(model))) == plain
    assert _names(master_state(nn.DataParallel(model))) == plain
    assert _names(master_state(torch.compile(nn.DataParallel(model)))) == plain
    nested = Tiny()
    nested.q_proj = torch.compile(nested.q_proj)  # a compiled submodule: model.q_proj._orig_mod.weight
    assert _names(master_state(nested)) == plain
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        assert _names(master_state(ddp)) == plain
        assert _names(master_state(torch.compile(ddp))) == plain
    finally:
        dist.destroy_process_group()
    assert all(a is b or a.data_ptr() == b.data_ptr() for a, b in zip(master_state(torch.compile(model)).values(),
                                                                       model.state_dict().values()))


def test_a_tied_weight_is_published_once_under_its_first_name() -> None:
    model = Tiny(tied=True)
    assert _names(master_state(model)) == ["embed.weight", "q_proj.weight", "q_proj.bias", "v_proj.weight"]
    # a state dict is taken as given, every name kept
    assert "head.weight" in master_state(model.state_dict())


# -- PEFT: a hand-built LoRA layer with peft's interface ------------------------------------------


class FakeLora(nn.Module):
    """peft's LoraLayer interface as the merge uses it: base_layer, lora_A/lora_B per adapter,
    scaling, active_adapters, merged, disable_adapters, get_delta_weight."""

    def __init__(self, base: nn.Linear, r: int = 2, adapters: tuple[str, ...] = ("default",)) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({a: nn.Linear(base.in_features, r, bias=False) for a in adapters})
        self.lora_B = nn.ModuleDict({a: nn.Linear(r, base.out_features, bias=False) for a in adapters})
        for a in adapters:
            nn.init.normal_(self.lora_B[a].weight)  # peft starts B at zero; a trained one is not
        self.scaling = {a: 0.5 for a in adapters}
        self.active_adapters = list(adapters)
        self.merged = False
        self.disable_adapters = False
        self.use_dora: dict[str, bool] = {}

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]


class FakeConfig:
    is_prompt_learning = False


class FakePeftModel(nn.Module):
    """A PeftModel's shape: the base model under ``base_model.model``, ``get_base_model``, ``peft_config``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = model
        self.peft_config = {"default": FakeConfig()}

    def get_base_model(self) -> nn.Module:
        return self.base_model.model


def _fake_peft(dtype: torch.dtype = torch.float32, adapters: tuple[str, ...] = ("default",)) -> FakePeftModel:
    model = Tiny(dtype=dtype)
    model.q_proj = FakeLora(model.q_proj, adapters=adapters).to(dtype)
    model.v_proj = FakeLora(model.v_proj, adapters=adapters).to(dtype)
    return FakePeftModel(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_model_publishes_merged_weights_under_the_base_names(dtype: torch.dtype) -> None:
    peft_model = _fake_peft(dtype, adapters=("default", "other"))
    base = peft_model.get_base_model()
    before = {n: t.clone() for n, t in peft_model.state_dict().items()}
    got = master_state(peft_model)
    assert _names(got) == list(Tiny().state_dict())  # base names, no base_layer, no lora_*
    for name in ("q_proj", "v_proj"):
        layer = getattr(base, name)
        want = layer.base_layer.weight.detach().clone()
        for adapter in ("default", "other"):  # added in turn in the weight's dtype, as peft merges
            want += layer.get_delta_weight(adapter).detach()
        assert torch.equal(got[f"{name}.weight"], want)
        assert got[f"{name}.weight"].dtype == dtype
    assert torch.equal(got["q_proj.bias"], base.q_proj.base_layer.bias)
    assert torch.equal(got["embed.weight"], base.embed.weight)
    after = peft_model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # the training model is untouched
    base.q_proj.active_adapters = ["default"]  # only the active adapters merge
    want = base.q_proj.base_layer.weight.detach() + base.q_proj.get_delta_weight("default").detach()
    assert torch.equal(master_state(peft_model)["q_proj.weight"], want)
    base.q_proj.disable_adapters = True
    assert torch.equal(master_state(peft_model)["q_proj.weight"], base.q_proj.base_layer.weight)


def test_lora_layers_that_cannot_be_merged_exactly_are_refused_by_name() -> None:
    peft_model = _fake_peft()
    base = peft_model.get_base_model()
    base.v_proj.use_dora = {"default": True}
    with pytest.raises(InvalidArgument, match=r"PEFT module 'v_proj' .*LoRA variant \(such as DoRA\)"):
        master_state(peft_model)
    base.v_proj.use_dora = {}
    base.v_proj.merged = True
    with pytest.raises(InvalidArgument, match="'v_proj'.*merged into the base layer"):
        master_state(peft_model)
    base.v_proj.merged = False
    base.q_proj.base_layer.register_buffer("absmax", torch.ones(1))  # as a quantized base layer holds
    with pytest.raises(InvalidArgument, match="'q_proj'.*quantized"):
        master_state(peft_model)
    other = _fake_peft()
    other.get_base_model().embed = FakeIA3(other.get_base_model().embed)
    with pytest.raises(InvalidArgument, match="'embed'.*not a LoRA layer"):
        master_state(other)


class FakeIA3(nn.Module):
    """An adapter layer (a base_layer) that is not LoRA."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base
        self.ia3_l = nn.ParameterDict({"default": nn.Parameter(torch.ones(8))})


# -- PEFT itself -------------------------------------------------------------------------------


def _tiny_llama(tied: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_a_peft_model_publishes_what_merge_and_unload_gives() -> None:
    peft = pytest.importorskip("peft")
    from weftboard.cuda.formats import ServedFormatSpec  # noqa: PLC0415
    from weftboard.publisher.hf_callback import publishable_state, trainer_model_files  # noqa: PLC0415

    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "embed_tokens"],
                                                               modules_to_save=["lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p))  # as training leaves them (lora_B starts at zero)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    for state in (publishable_state(model), master_state(model), publishable_state(torch.compile(model))):
        assert list(state) == list(want)
        assert all(torch.equal(state[n], want[n]) for n in want), [n for n in want if not torch.equal(state[n], want[n])]
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[n], after[n]) for n in before)  # untouched
    config = trainer_model_files(model, None, ServedFormatSpec("bf16"))[0]
    assert config.architectures == ["LlamaForCausalLM"]

    dora = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(InvalidArgument, match=r"'model\.layers\.0\.self_attn\.q_proj'.*DoRA"):
        publishable_state(dora)


@pytest.mark.parametrize(("dtype", "adapter_dtype"), [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.float32)])
def test_two_active_adapters_publish_the_bytes_merge_and_unload_gives(dtype: torch.dtype,
                                                                      adapter_dtype: torch.dtype) -> None:
    """Two LoRA adapters active on the same Linear and Embedding modules: peft merges them one
    after another into the weight in the weight's dtype (an Embedding's delta cast to it first),
    so a bf16 weight is rounded once per adapter; the published bytes are exactly those."""
    peft = pytest.importorskip("peft")

    def config() -> Any:
        return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "embed_tokens"])

    autocast = adapter_dtype == torch.float32  # peft's default: a bf16 model's adapters in float32
    model = peft.get_peft_model(_tiny_llama().to(dtype), config(), adapter_name="first",
                                autocast_adapter_dtype=autocast)
    model.add_adapter("second", config(), autocast_adapter_dtype=autocast)
    model.base_model.set_adapter(["first", "second"])  # both active: merge_and_unload merges both
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p, dtype=torch.float32).to(adapter_dtype))  # trained: B is not zero
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert len(layers) == 5 and all(list(m.active_adapters) == ["first", "second"] for m in layers)
    assert all(m.base_layer.weight.dtype == dtype for m in layers)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {adapter_dtype}
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    only_first = copy.deepcopy(model).merge_and_unload(adapter_names=["first"]).state_dict()
    merged = [n for n in want if not torch.equal(want[n], only_first[n])]
    assert len(merged) == 5 and "model.embed_tokens.weight" in merged  # the second adapter is merged too
    got = master_state(model)
    assert list(got) == list(want)
    differ = [n for n in want if got[n].dtype != want[n].dtype or got[n].shape != want[n].shape
              or not torch.equal(got[n].contiguous().view(torch.uint8), want[n].contiguous().view(torch.uint8))]
    assert not differ, differ


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_a_tied_tensor_with_an_adapter_is_published_once_merged(target: str) -> None:
    """Tied embeddings with LoRA on one of the two names: ``merge_and_unload`` merges into the
    shared storage, so both names hold the merged weight, published once under the first name."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(tied=True), peft.LoraConfig(r=4, target_modules=["q_proj", target]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    got = master_state(model)
    assert "lm_head.weight" not in got and "model.embed_tokens.weight" in got
    assert all(torch.equal(got[n], want[n]) for n in got), [n for n in got if not torch.equal(got[n], want[n])]
    assert torch.equal(got["model.embed_tokens.weight"], want["lm_head.weight"])


def test_a_trained_copy_of_a_tied_tensor_is_refused() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(tied=True), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                          modules_to_save=["lm_head"]))
    with pytest.raises(InvalidArgument, match=r"'lm_head'.*tied to 'model\.embed_tokens\.weight'"):
        master_state(model)


# -- a publisher that is not closed ------------------------------------------------------------


def test_a_publisher_left_open_is_closed_when_it_is_garbage() -> None:
    pub = Publisher("127.0.0.1:1", "left-open")
    work_dir, thread = pub.work_dir, pub._thread
    assert work_dir.is_dir()
    del pub
    gc.collect()
    assert not work_dir.exists()
    thread.join(10)
    assert not thread.is_alive()


async def test_a_connected_publisher_left_open_is_closed_when_it_is_garbage(board, local_store) -> None:
    trainer = Trainer(lr=1e-4)

    def publish_and_drop() -> tuple[Path, threading.Thread]:
        pub = Publisher(board.address, "dropped", token=board.admin_token, blob_store=local_store)
        pub.publish(trainer.model, step=1).result(60)
        return pub.work_dir, pub._thread

    work_dir, thread = await asyncio.to_thread(publish_and_drop)
    gc.collect()
    assert not work_dir.exists()
    await asyncio.to_thread(thread.join, 10)
    assert not thread.is_alive()


def test_a_publisher_left_open_at_exit_removes_its_work_dir() -> None:
    probe = ("from weftboard.publisher.publisher import Publisher\n"
             "pub = Publisher('127.0.0.1:1', 'at-exit')\n"
             "print(pub.work_dir, flush=True)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    work_dir = Path(result.stdout.strip())
    assert work_dir.name.startswith("weftboard-pub-")
    assert not work_dir.exists()


# -- a publish waiting for a slot ---------------------------------------------------------------


def test_a_publish_waiting_for_a_slot_logs_while_it_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    pub = Publisher("127.0.0.1:1", "waits", max_pending=2)
    try:
        monkeypatch.setattr(Publisher, "WAIT_LOG_S", 0.2, raising=False)
        monkeypatch.setattr(Publisher, "WAIT_LOG_EVERY_S", 0.3, raising=False)
        pending = [2]
        pub.pending = lambda: pending[0]  # two versions pending, none commits for a while

        def commit_one() -> None:
            time.sleep(1.0)
            with pub._cond:
                pending[0] = 1
                pub._cond.notify_all()

        threading.Thread(target=commit_one, daemon=True).start()
        with structlog.testing.capture_logs() as logs:
            t = time.monotonic()
            assert pub._reserve_slot() is None
            waited = time.monotonic() - t
        waits = [e for e in logs if "waits for a pending version" in e["event"]]
        assert 0.9 < waited < 3.0
        assert 2 <= len(waits) <= 4, waits
        assert all(e["log_level"] == "info" and e["pending"] == 2 and e["run"] == "waits" for e in waits)
        assert waits[0]["waited_s"] >= 0.2
        with structlog.testing.capture_logs() as logs:
            assert pub._reserve_slot() is None  # room at once: nothing logged
        assert not logs
    finally:
        pub.close(flush=False)


# -- the callback ------------------------------------------------------------------------------


def test_the_callback_closes_its_publisher_when_on_train_begin_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from transformers import TrainerState  # noqa: PLC0415

    from weftboard.publisher import WeftboardCallback  # noqa: PLC0415

    opened: list[Publisher] = []

    def refuse(self: Publisher, *args: Any, **kwargs: Any) -> None:
        opened.append(self)
        raise ConnectionError("board unreachable (simulated)")

    monkeypatch.setattr(Publisher, "connect", refuse)
    weft = WeftboardCallback("127.0.0.1:1", "begin-fails", model_files=())
    with pytest.raises(ConnectionError, match="simulated"):
        weft.on_train_begin(None, TrainerState(max_steps=2, is_world_process_zero=True), None, model=Tiny())
    assert weft.publisher is None
    assert len(opened) == 1 and opened[0]._jobs.closed
    assert not opened[0].work_dir.exists()


def test_a_publisher_with_a_metrics_endpoint_left_open_is_closed_when_it_is_garbage() -> None:
    """The endpoint's gauge reads the publisher weakly, so it does not keep it alive; the
    finalizer stops the endpoint too."""
    import urllib.request

    pub = Publisher("127.0.0.1:1", "left-open-metrics", metrics_port=0)
    work_dir, port, ref = pub.work_dir, pub.metrics.port, weakref.ref(pub)
    assert port
    del pub
    gc.collect()
    assert ref() is None and not work_dir.exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
