"""Direct writes into a vLLM-shaped model: placements, staging, writing, packed CPU kernels.

The modules here carry the class names and attributes vLLM's layers have (``QKVParallelLinear``
with ``num_heads``/``num_kv_heads``/``tp_rank``..., ``MergedColumnParallelLinear`` with
``output_sizes``, ``RowParallelLinear``, ``VocabParallelEmbedding``), so tensor-parallel shards
can be checked without several GPUs. What each rank must hold is written here independently,
with ``torch.chunk`` over whole heads and rows. The real engine is in tests/test_vllm_live.py.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from weftboard.cuda.anchors import write_checkpoint
from weftboard.cuda.codec import encode_patch
from weftboard.subscriber.bench.vllm_kit import version_record
from weftboard.subscriber.destination import VersionTarget
from weftboard.subscriber.engines import vllm_worker
from weftboard.subscriber.engines.vllm_live import LiveParams
from weftboard.subscriber.engines.vllm_params import Unplaceable, place_checkpoint
from weftboard.subscriber.engines.vllm_worker import (
    WeftboardWorkerExtension,
    target_to_json,
)

BF16 = torch.bfloat16
HIDDEN, HEAD, INTER, VOCAB = 16, 4, 24, 20


def _p(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=BF16), requires_grad=False)


class QKVParallelLinear(nn.Module):
    def __init__(self, heads: int, kv_heads: int, rank: int, tp: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.head_size = rank, tp, HEAD
        self.num_heads = heads // tp
        self.num_kv_heads = max(1, kv_heads // tp)
        self.num_kv_head_replicas = max(1, tp // kv_heads)
        self.output_size_per_partition = (self.num_heads + 2 * self.num_kv_heads) * HEAD
        self.input_size_per_partition = HIDDEN
        self.weight = _p(self.output_size_per_partition, HIDDEN)


class MergedColumnParallelLinear(nn.Module):
    def __init__(self, rank: int, tp: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.output_sizes = rank, tp, [INTER, INTER]
        self.output_size_per_partition, self.input_size_per_partition = 2 * INTER // tp, HIDDEN
        self.weight = _p(2 * INTER // tp, HIDDEN)


class RowParallelLinear(nn.Module):
    def __init__(self, out: int, inp: int, rank: int, tp: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = rank, tp
        self.input_size_per_partition, self.output_size_per_partition = inp // tp, out
        self.weight = _p(out, inp // tp)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rank: int, tp: int, padded: int = 4) -> None:
        super().__init__()
        rows = VOCAB // tp
        self.tp_rank = rank
        self.shard_indices = SimpleNamespace(org_vocab_start_index=rank * rows, org_vocab_end_index=(rank + 1) * rows)
        self.weight = _p(rows + padded, HIDDEN)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = _p(HIDDEN)


class TinyVllmLlama(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, heads: int = 4, kv_heads: int = 2, rank: int = 0, tp: int = 1, tied: bool = True) -> None:
        super().__init__()
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = QKVParallelLinear(heads, kv_heads, rank, tp)
        layer.self_attn.o_proj = RowParallelLinear(HIDDEN, heads * HEAD, rank, tp)
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = MergedColumnParallelLinear(rank, tp)
        layer.mlp.down_proj = RowParallelLinear(HIDDEN, INTER, rank, tp)
        layer.input_layernorm = RMSNorm()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.model.embed_tokens = VocabParallelEmbedding(rank, tp)
        self.model.norm = RMSNorm()
        self.lm_head = ParallelLMHead(rank, tp)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def checkpoint(seed: int = 0, heads: int = 4, kv_heads: int = 2, tied: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(BF16)

    p = "model.layers.0."
    t = {p + "self_attn.q_proj.weight": w(heads * HEAD, HIDDEN), p + "self_attn.k_proj.weight": w(kv_heads * HEAD, HIDDEN),
         p + "self_attn.v_proj.weight": w(kv_heads * HEAD, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, heads * HEAD),
         p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
         p + "mlp.down_proj.weight": w(HIDDEN, INTER), p + "input_layernorm.weight": w(HIDDEN),
         "model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": w(HIDDEN)}
    if not tied:
        t["lm_head.weight"] = w(VOCAB, HIDDEN)
    return t


def load(model: nn.Module, shadow: dict[str, torch.Tensor]) -> LiveParams:
    """What vLLM's loader does, through the placements (checked against the chunks below)."""
    for p in place_checkpoint(model, {n: tuple(t.shape) for n, t in shadow.items()}):
        p.target_of(getattr(model.get_submodule(p.module), p.param).data).copy_(p.source_of(shadow[p.name]))
    return LiveParams.bind(model, shadow, None)


def expected_shard(ckpt: dict[str, torch.Tensor], rank: int, tp: int, kv_heads: int) -> dict[str, torch.Tensor]:
    p = "model.layers.0."
    kv_rank = rank // (tp // kv_heads) if tp > kv_heads else rank  # ranks past the KV heads share them
    kv_parts = max(1, min(tp, kv_heads))
    return {
        "qkv": torch.cat([ckpt[p + "self_attn.q_proj.weight"].chunk(tp)[rank],
                          ckpt[p + "self_attn.k_proj.weight"].chunk(kv_parts)[kv_rank],
                          ckpt[p + "self_attn.v_proj.weight"].chunk(kv_parts)[kv_rank]]),
        "gate_up": torch.cat([ckpt[p + "mlp.gate_proj.weight"].chunk(tp)[rank], ckpt[p + "mlp.up_proj.weight"].chunk(tp)[rank]]),
        "o": ckpt[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[rank],
        "down": ckpt[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank],
        "embed": ckpt["model.embed_tokens.weight"].chunk(tp)[rank],
    }


@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 2), (2, 1), (4, 2)])
def test_each_rank_holds_its_shard_of_every_fused_tensor(tp: int, kv_heads: int) -> None:
    ckpt = checkpoint(kv_heads=kv_heads)
    for rank in range(tp):
        model = TinyVllmLlama(kv_heads=kv_heads, rank=rank, tp=tp)
        live = load(model, ckpt)
        want = expected_shard(ckpt, rank, tp, kv_heads)
        layer = model.model.layers[0]
        assert torch.equal(layer.self_attn.qkv_proj.weight, want["qkv"])
        assert torch.equal(layer.mlp.gate_up_proj.weight, want["gate_up"])
        assert torch.equal(layer.self_attn.o_proj.weight, want["o"])
        assert torch.equal(layer.mlp.down_proj.weight, want["down"])
        rows = VOCAB // tp
        assert torch.equal(model.model.embed_tokens.weight[:rows], want["embed"])
        assert torch.equal(model.lm_head.weight[:rows], want["embed"])  # tied: the same parameter
        assert live.mismatches(ckpt) == []


def test_an_untied_head_is_placed_on_its_own() -> None:
    ckpt = checkpoint(tied=False)
    model = TinyVllmLlama(tied=False)
    load(model, ckpt)
    assert torch.equal(model.lm_head.weight[:VOCAB], ckpt["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight[:VOCAB], model.model.embed_tokens.weight[:VOCAB])


def _step(ckpt: dict[str, torch.Tensor], seed: int, every: int = 7) -> tuple[dict[str, torch.Tensor], int]:
    """A sparse change of a few bf16 elements in some tensors; the number of elements changed."""
    g = torch.Generator().manual_seed(seed)
    new, changed = {}, 0
    for i, (name, t) in enumerate(sorted(ckpt.items())):
        t = t.clone()
        if i % 3 != 2:
            mask = torch.rand(t.shape, generator=g) < 1 / every
            t[mask] = (t[mask].float() + 0.5).to(BF16)
            changed += int((t.view(torch.int16) != ckpt[name].view(torch.int16)).sum())
        new[name] = t
    return new, changed


@pytest.mark.parametrize("tp", [1, 2])
def test_a_staged_write_puts_exactly_the_new_bytes_in_place(tp: int) -> None:
    ckpt = checkpoint()
    models = [TinyVllmLlama(rank=r, tp=tp) for r in range(tp)]
    lives = [load(m, ckpt) for m in models]
    new, changed = _step(ckpt, seed=1)
    staged = [live.stage(new, list(new)) for live in lives]
    assert all(live.mismatches(ckpt) == [] for live in lives)  # staging leaves the model alone
    if tp == 1:
        assert staged[0].elements == changed  # only the differing elements are written
    else:
        assert sum(s.elements for s in staged) >= changed
    for live, s in zip(lives, staged, strict=True):
        live.write(s)
        assert live.mismatches(new) == []
        assert live.stage(new, list(new)).elements == 0


def test_a_replaced_parameter_makes_a_staging_stale() -> None:
    model = TinyVllmLlama()
    live = load(model, checkpoint())
    assert live.stale() == []
    model.model.norm.weight = _p(HIDDEN)
    assert live.stale() == ["model.norm.weight"]


def test_what_cannot_be_placed_exactly_is_refused() -> None:
    ckpt = checkpoint()
    with pytest.raises(Unplaceable, match="no module"):
        place_checkpoint(TinyVllmLlama(), {**{n: tuple(t.shape) for n, t in ckpt.items()}, "vision.proj.weight": (2, 2)})
    wrong = {n: tuple(t.shape) for n, t in ckpt.items()}
    wrong["model.norm.weight"] = (HIDDEN + 1,)
    with pytest.raises(Unplaceable, match="does not fit"):
        place_checkpoint(TinyVllmLlama(), wrong)
    model = TinyVllmLlama()
    model.model.norm.weight = nn.Parameter(torch.zeros(HIDDEN), requires_grad=False)  # float32 in the engine
    with pytest.raises(Unplaceable, match="float32"):
        LiveParams.bind(model, ckpt, None)


# -- packed CPU kernels: a oneDNN-like handle that owns a packed copy ----------------------------

_PACKED: dict[int, torch.Tensor] = {}


class FakeHandle:
    """Like vLLM's CPUDNNLGEMMHandler: the packed weight lives behind a pointer in a tensor."""

    def __init__(self, weight: torch.Tensor) -> None:
        key = max(_PACKED, default=0) + 1
        _PACKED[key] = weight.detach().t().contiguous()  # "packed": another layout
        self.handler_tensor = torch.tensor(key, dtype=torch.int64)
        self.k, self.n = weight.shape[1], weight.shape[0]

    def __del__(self) -> None:
        _PACKED.pop(int(self.handler_tensor.item()), None)


def fake_pack(module: nn.Module) -> object:
    handler = FakeHandle(module.weight)
    module.weight = nn.Parameter(torch.empty(0, dtype=BF16), requires_grad=False)
    return lambda x, weight, bias: x @ _PACKED[int(handler.handler_tensor.item())]


def packed_model(ckpt: dict[str, torch.Tensor]) -> tuple[TinyVllmLlama, LiveParams]:
    model = TinyVllmLlama()
    for p in place_checkpoint(model, {n: tuple(t.shape) for n, t in ckpt.items()}):
        p.target_of(getattr(model.get_submodule(p.module), p.param).data).copy_(p.source_of(ckpt[p.name]))
    for module in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].mlp.gate_up_proj):
        module.cpu_linear = fake_pack(module)  # the weight is gone: only the kernel holds it
    return model, LiveParams.bind(model, ckpt, fake_pack)


def test_a_packed_kernel_takes_the_new_weight_without_being_replaced() -> None:
    ckpt = checkpoint()
    model, live = packed_model(ckpt)
    qkv = model.model.layers[0].self_attn.qkv_proj
    kernel, handle_tensor = qkv.cpu_linear, qkv.cpu_linear.__closure__[0].cell_contents.handler_tensor
    assert live.mismatches(ckpt) == []
    new, _ = _step(ckpt, seed=2, every=2)
    staged = live.stage(new, list(new))
    live.write(staged)
    del staged
    x = torch.randn(3, HIDDEN).to(BF16)
    p = "model.layers.0.self_attn."
    fused = torch.cat([new[p + "q_proj.weight"], new[p + "k_proj.weight"], new[p + "v_proj.weight"]])
    assert torch.equal(qkv.cpu_linear(x, qkv.weight, None), x @ fused.t())
    # the compiled model's references stay valid: same function, same handle tensor
    assert qkv.cpu_linear is kernel
    assert kernel.__closure__[0].cell_contents.handler_tensor is handle_tensor
    assert live.mismatches(new) == [] and live.stale() == []
    # the old packed copies were released with the staging, one copy per kernel remains
    assert len(_PACKED) == 2


def test_a_kernel_packed_from_other_bytes_is_a_mismatch() -> None:
    ckpt = checkpoint()
    _, live = packed_model(ckpt)
    other, _ = _step(ckpt, seed=3, every=2)
    assert "model.layers.0.self_attn.qkv_proj" in live.mismatches(other)


# -- the worker extension on such a model: staging, commit, and a write that fails -------------


class FakeWorker(WeftboardWorkerExtension):
    """vLLM's worker as the extension sees it: ``model_runner.get_model()``, ``reload_weights``
    (here: the loader through the placements), ``device`` and ``rank``."""

    def __init__(self, model: nn.Module) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.model_config = SimpleNamespace(hf_text_config=SimpleNamespace(tie_word_embeddings=True))
        self.device, self.rank, self.loads = torch.device("cpu"), 0, 0

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool = True) -> None:  # noqa: ANN001
        tensors = dict(weights_iterator)
        model = self.model_runner.get_model()
        for p in place_checkpoint(model, {n: tuple(t.shape) for n, t in tensors.items()}):
            p.target_of(getattr(model.get_submodule(p.module), p.param).data).copy_(p.source_of(tensors[p.name]))
        self.loads += 1


def versions_on_disk(tmp_path: Path, count: int) -> list[tuple[Path, VersionTarget, Path | None]]:
    ckpt, out = checkpoint(), []
    for v in range(count + 1):
        patch = None
        if v:
            new, _ = _step(ckpt, seed=10 + v)
            record = version_record(v, new)
            patch = tmp_path / f"v{v}.patch"
            patch.write_bytes(encode_patch(((n, ckpt[n], new[n]) for n in sorted(ckpt)), base_version=v - 1,
                                           target_version=v, target_root=record.root_digest).data)
            ckpt = new
        write_checkpoint(tmp_path / f"v{v}", sorted(ckpt.items()))
        out.append((tmp_path / f"v{v}", version_record(v, ckpt), patch))
    return out


def test_the_worker_stages_then_commits_and_a_failed_write_is_put_back(tmp_path: Path, monkeypatch) -> None:
    versions = versions_on_disk(tmp_path, 3)
    model = TinyVllmLlama()
    worker = FakeWorker(model)
    folder, v0, _ = versions[0]
    assert worker.weftboard_attach(str(folder), target_to_json(v0))["write_mode"] == "direct"
    assert worker.weftboard_digest(deep=True)["root"] == v0.root_digest
    # staged while serving, committed without the loader
    _, v1, patch1 = versions[1]
    assert worker.weftboard_stage_patch(str(patch1), target_to_json(v1))["status"] == "staging"
    worker.weftboard_staged.thread.join()
    assert worker.weftboard_stage_status()["status"] == "staged"
    assert worker.weftboard_digest()["version"] == 0  # nothing reached the model yet
    answer = worker.weftboard_commit(target_to_json(v1))
    assert (answer["status"], answer["root"], worker.loads) == ("ok", v1.root_digest, 1)
    assert worker.weftboard_digest(deep=True)["root"] == v1.root_digest
    # a commit that fails half-way: the old bytes go back into the model, and the answer says so
    _, v2, patch2 = versions[2]
    real_write = LiveParams.write
    calls = []

    def failing_write(self: LiveParams, staged) -> None:  # noqa: ANN001
        calls.append(1)
        if len(calls) == 1:
            first = staged.changes[: len(staged.changes) // 2]
            real_write(self, type(staged)(first, []))  # torn: half of it is written
            raise RuntimeError("device lost mid-write")
        real_write(self, staged)

    monkeypatch.setattr(LiveParams, "write", failing_write)
    answer = worker.weftboard_apply_patch(str(patch2), target_to_json(v2))
    assert (answer["status"], answer["restored"], answer["version"]) == ("install_failed", True, 1)
    assert "device lost" in answer["error"]
    deep = worker.weftboard_digest(deep=True)
    assert (deep["status"], deep["version"], deep["root"]) == ("ok", 1, v1.root_digest)
    # and the same patch goes in afterwards
    monkeypatch.setattr(LiveParams, "write", real_write)
    assert worker.weftboard_apply_patch(str(patch2), target_to_json(v2))["status"] == "ok"
    assert worker.weftboard_digest(deep=True)["root"] == v2.root_digest


def test_a_shallow_digest_answers_at_once_while_a_patch_stages(tmp_path: Path, monkeypatch) -> None:
    """The island's health probe asks the workers for their version (not deep) every few seconds;
    inside the engine that call must not wait for a staging under way, which may take seconds:
    the staging patches the shadow's bytes, not the version and root the worker vouches for."""
    versions = versions_on_disk(tmp_path, 1)
    worker = FakeWorker(TinyVllmLlama())
    folder, v0, _ = versions[0]
    worker.weftboard_attach(str(folder), target_to_json(v0))
    release = threading.Event()
    real_apply = vllm_worker.apply_patch_

    def slow_apply(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        release.wait(30)
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(vllm_worker, "apply_patch_", slow_apply)
    _, v1, patch1 = versions[1]
    assert worker.weftboard_stage_patch(str(patch1), target_to_json(v1))["status"] == "staging"
    try:
        answers: list[dict] = []
        probe = threading.Thread(target=lambda: answers.append(worker.weftboard_digest()))
        probe.start()
        probe.join(5)
        assert answers and (answers[0]["status"], answers[0]["version"], answers[0]["root"]) == (
            "ok", v0.version, v0.root_digest)
        assert worker.weftboard_staged.thread.is_alive()  # the staging still runs
    finally:
        release.set()
    worker.weftboard_staged.thread.join()
    assert worker.weftboard_stage_status()["status"] == "staged"


def test_a_commit_names_exactly_the_staged_record(tmp_path: Path) -> None:
    versions = versions_on_disk(tmp_path, 1)
    worker = FakeWorker(TinyVllmLlama())
    folder, v0, _ = versions[0]
    worker.weftboard_attach(str(folder), target_to_json(v0))
    _, v1, patch1 = versions[1]
    worker.weftboard_stage_patch(str(patch1), target_to_json(v1))
    other = VersionTarget(v1.version, v1.root_digest, {**v1.tensor_digests}, list(v1.layout)[::-1])
    answer = worker.weftboard_commit(target_to_json(other))
    assert answer["status"] == "needs_attach" and "nothing is staged" in answer["error"]
    deep = worker.weftboard_digest(deep=True)  # the staging was undone: the shadow is version 0 again
    assert (deep["status"], deep["root"]) == ("ok", v0.root_digest)
