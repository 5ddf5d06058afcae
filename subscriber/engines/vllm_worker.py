"""The weftboard side of a vLLM worker: patches applied inside the engine's own processes.

vLLM loads it with ``--worker-extension-cls
weftboard.subscriber.engines.vllm_worker.WeftboardWorkerExtension``; the island reaches its
methods through ``POST /collective_rpc`` (every worker of the engine runs the call). Each worker
keeps the served weights under their checkpoint names (the bytes the board's patches were
diffed against, in host memory) and applies a patch to them with the island's own codec, so the
result is bitwise the island's. Only then does it hand the tensors a patch touched to the
model's own ``load_weights`` (vLLM's layer-wise in-place reload): vLLM's mapping onto its
parameters does the rest (``q/k/v_proj`` into ``qkv_proj``, ``gate/up_proj`` into
``gate_up_proj``, tied embeddings, the tensor-parallel slice this worker holds, the CPU
kernels' weight packing). A module is always handed over whole (all its checkpoint tensors).

Invariants:
- The patched tensors are verified (every tensor digest and the root digest of the version
  record) before any byte reaches the model; a mismatch is reverted and the model untouched.
- A failed hand-over puts the previous bytes of every touched module back; the answer says
  whether that worked (``restored``): the engine is never left on torn weights unknowingly.
- ``weftboard_digest`` reports the version and root digest of what this worker handed the
  model; a fresh process (an engine that restarted) reports version 0 until ``weftboard_attach``
  (a full, verified load from a checkpoint folder) sets it.
- Calls answer a JSON object with ``status`` (``ok``, ``needs_attach``, ``layout``,
  ``rejected``, ``install_failed``) instead of raising, so the island gets a precise reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from weftboard.cuda.anchors import checkpoint_files, load_safetensors_buffer
from weftboard.cuda.codec import CODEC_TILE, apply_patch_, encode_patch
from weftboard.proto.errors import WeftboardError
from weftboard.subscriber.destination import (
    TensorEntry,
    VersionTarget,
    require_transition,
)
from weftboard.subscriber.verify import check_layout, verify_tensors


def target_to_json(target: VersionTarget) -> str:
    """The version record as one JSON string (``collective_rpc`` passes strings through)."""
    return json.dumps({
        "version": target.version, "root_digest": target.root_digest,
        "tensor_digests": dict(target.tensor_digests),
        "layout": [[e.name, e.dtype, list(e.shape)] for e in target.layout],
    })


def target_from_json(text: str) -> VersionTarget:
    raw = json.loads(text)
    return VersionTarget(
        version=int(raw["version"]), root_digest=raw["root_digest"], tensor_digests=raw["tensor_digests"],
        layout=[TensorEntry(name, dtype, tuple(shape)) for name, dtype, shape in raw["layout"]],
    )


def module_groups(names: list[str], packed: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """Checkpoint names grouped by the vLLM module they load into (``packed`` is the model's
    ``packed_modules_mapping``: ``q_proj`` -> ``qkv_proj`` and so on)."""
    fused_of = {part: fused for fused, parts in packed.items() for part in parts}
    groups: dict[str, list[str]] = {}
    for name in names:
        module, _, _ = name.rpartition(".")
        head, _, last = module.rpartition(".")
        key = f"{head}.{fused_of[last]}" if last in fused_of else module
        groups.setdefault(key, []).append(name)
    return groups


class WorkerWeights:
    """One worker's checkpoint-named copy of the served weights and what it last verified."""

    def __init__(self, tensors: dict[str, torch.Tensor], buffers: list[torch.Tensor], target: VersionTarget,
                 digests: dict[str, str]) -> None:
        self.tensors = tensors
        self.buffers = buffers  # the owned storage the tensors view
        self.version = target.version
        self.root = target.root_digest
        self.digests = digests


class WeftboardWorkerExtension:
    """Mixed into vLLM's worker class; every public name starts with ``weftboard_``."""

    def weftboard_digest(self) -> dict[str, Any]:
        held = getattr(self, "weftboard_weights", None)
        if held is None:
            return {"status": "ok", "version": 0, "root": None, "rank": self._weftboard_rank()}
        return {"status": "ok", "version": held.version, "root": held.root, "rank": self._weftboard_rank()}

    def weftboard_warm_up(self) -> dict[str, Any]:
        """Compile (or load from numba's disk cache) the codec kernels a patch of bf16 takes, so the
        first swap does not compile inside the pause; the island calls it while the engine serves."""
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(0)
        old = torch.randn(2 * CODEC_TILE + 777, generator=gen).to(torch.bfloat16)
        news = {"sparse": old.clone(), "dense": (old.float() * 1.01).to(torch.bfloat16), "every": old + 1}
        news["sparse"][::97] += 1
        patch = encode_patch(((n, old, new) for n, new in news.items()), base_version=0, target_version=1,
                             target_root="")
        live = {n: old.clone() for n in news}
        apply_patch_(live, patch.data).revert()
        return self._weftboard_answer("ok", "", seconds=time.perf_counter() - t0)

    def weftboard_attach(self, checkpoint_dir: str, target: str) -> dict[str, Any]:
        """Load a verified checkpoint folder whole into the model and keep its bytes."""
        record = target_from_json(target)
        t0 = time.perf_counter()
        held: WorkerWeights | None = getattr(self, "weftboard_weights", None)
        if held is not None:
            try:
                check_layout(held.tensors, record)
            except WeftboardError as exc:
                return self._weftboard_answer("layout", f"{exc}; the model was not touched", version=held.version)
        try:
            tensors: dict[str, torch.Tensor] = {}
            buffers = []
            for path in checkpoint_files(Path(checkpoint_dir)):
                part, buf = load_safetensors_buffer(path)
                tensors.update(part)
                buffers.append(buf)
            digests = verify_tensors(tensors, record)
        except (WeftboardError, OSError) as exc:
            return self._weftboard_answer("rejected", f"checkpoint {checkpoint_dir} refused: {exc}")
        self.weftboard_weights = None  # the model is about to change: nothing is vouched for until it succeeds
        try:
            self._weftboard_install(tensors, list(tensors))
        except Exception as exc:  # noqa: BLE001 - vLLM's loaders raise anything; the island must hear it
            return self._weftboard_answer("install_failed", f"loading {checkpoint_dir}: {exc!r}", restored=False)
        self.weftboard_weights = WorkerWeights(tensors, buffers, record, digests)
        return self._weftboard_answer("ok", "", version=record.version, root=record.root_digest,
                                      seconds=time.perf_counter() - t0)

    def weftboard_apply_patch(self, patch_path: str, target: str) -> dict[str, Any]:
        """Apply one patch (``target.version - 1`` -> ``target.version``) to the live model."""
        record = target_from_json(target)
        held: WorkerWeights | None = getattr(self, "weftboard_weights", None)
        if held is None or held.version != record.version - 1:
            return self._weftboard_answer(
                "needs_attach", f"this worker holds version {0 if held is None else held.version}, "
                f"the patch needs {record.version - 1}", version=0 if held is None else held.version)
        t0 = time.perf_counter()
        try:
            check_layout(held.tensors, record)
        except WeftboardError as exc:
            return self._weftboard_answer("layout", str(exc), version=held.version)
        try:
            data = Path(patch_path).read_bytes()
            applied = apply_patch_(held.tensors, data)  # all or nothing
        except (WeftboardError, OSError) as exc:
            return self._weftboard_answer("rejected", f"patch {patch_path}: {exc}", version=held.version)
        touched = [n for n, c in applied.changed.items() if c]
        try:
            require_transition(applied.base_version, applied.target_version, record)
            digests = verify_tensors(held.tensors, record, rehash=touched, cache=held.digests)
        except WeftboardError as exc:
            applied.revert()
            return self._weftboard_answer("rejected", f"{exc}; reverted, the model was not touched",
                                          version=held.version)
        t1 = time.perf_counter()
        packed = getattr(self.model_runner.get_model(), "packed_modules_mapping", {}) or {}
        groups = module_groups(list(held.tensors), packed)
        changed = set(touched)
        wanted = {g for g, names in groups.items() if not changed.isdisjoint(names)}
        names = [n for g in wanted for n in groups[g]]
        try:
            self._weftboard_install(held.tensors, names)
        except Exception as exc:  # noqa: BLE001 - any loader failure must put the old bytes back
            applied.revert()
            try:
                self._weftboard_install(held.tensors, names)
            except Exception as again:  # noqa: BLE001
                self.weftboard_weights = None
                return self._weftboard_answer("install_failed", f"{exc!r}; restoring failed too: {again!r}",
                                              restored=False, version=0)
            return self._weftboard_answer("install_failed", f"{exc!r}; the previous bytes are back",
                                          restored=True, version=held.version)
        held.version, held.root, held.digests = record.version, record.root_digest, digests
        return self._weftboard_answer("ok", "", version=record.version, root=record.root_digest,
                                      tensors=len(touched), modules=len(wanted),
                                      apply_s=t1 - t0, install_s=time.perf_counter() - t1)

    def weftboard_retie(self) -> dict[str, Any]:
        """Tie the output head to the input embedding again and redo its kernel preparation.

        vLLM's reload loads no weight into a tied ``lm_head`` (it shares the embedding's), so
        the copy its CPU kernels packed at start-up stays on the old version; after vLLM's own
        ``reload_weights`` the island calls this, after our hand-over we do."""
        model = self.model_runner.get_model()
        config = getattr(self.model_config, "hf_text_config", None)
        head = getattr(model, "lm_head", None)
        embed = next((m for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
        if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
            return self._weftboard_answer("ok", "", tied=False)
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)
        return self._weftboard_answer("ok", "", tied=True)

    def _weftboard_install(self, tensors: Mapping[str, torch.Tensor], names: list[str]) -> None:
        """Hand checkpoint tensors to the model's loader (vLLM's in-place layer-wise reload)."""
        self.reload_weights(weights_iterator=[(n, tensors[n]) for n in names], is_checkpoint_format=True)
        if any(n.endswith("embed_tokens.weight") for n in names):
            self.weftboard_retie()

    def _weftboard_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def _weftboard_answer(self, status: str, error: str, **fields: Any) -> dict[str, Any]:
        return {"status": status, "error": error, "rank": self._weftboard_rank(), **fields}
