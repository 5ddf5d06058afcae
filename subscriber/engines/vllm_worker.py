"""The weftboard side of a vLLM worker: patches applied inside the engine's own processes.

vLLM loads it with ``--worker-extension-cls
weftboard.subscriber.engines.vllm_worker.WeftboardWorkerExtension``; the island reaches its
methods through ``POST /collective_rpc`` (every worker of the engine runs the call, between two
engine steps). Each worker keeps the served weights under their checkpoint names (the bytes the
board's patches were diffed against, in host memory: the shadow) and applies a patch to them with
the island's own codec, so the result is bitwise the island's.

Two ways the verified bytes reach the model (``write_mode``):
- ``direct`` (``vllm_live``): every checkpoint tensor is placed in the engine's live parameters
  (fused ``qkv_proj``/``gate_up_proj`` rows, this worker's tensor-parallel slice, tied
  embeddings). ``weftboard_stage_patch`` applies and verifies the patch on the shadow and finds
  the elements that differ, in a background thread while the engine serves;
  ``weftboard_commit`` (the engine paused) writes just those elements;
- ``loader``: a model the placements do not cover exactly takes the touched modules through
  vLLM's own ``load_weights`` (its layer-wise in-place reload).

Invariants:
- The patched tensors are verified (every tensor digest and the root digest of the version
  record) before any byte reaches the model; a mismatch is reverted and the model untouched.
- A failed write puts the previous bytes back; the answer says whether that worked
  (``restored``): the engine is never left on torn weights unknowingly.
- ``weftboard_digest`` reports the version and root digest of what this worker handed the
  model (``deep``: after comparing the live parameters with the shadow bit for bit); a fresh
  process (an engine that restarted) reports version 0 until ``weftboard_attach`` (a full,
  verified load from a checkpoint folder) sets it. ``weftboard_detach`` comes before vLLM
  reloads weights itself, ``weftboard_adopt`` after it.
- Calls answer a JSON object with ``status`` (``ok``, ``staging``, ``staged``, ``needs_attach``,
  ``layout``, ``rejected``, ``install_failed``) instead of raising, so the island gets a precise
  reason.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weftboard.cuda.anchors import checkpoint_files, load_safetensors_buffer
from weftboard.cuda.apply import AppliedPatch
from weftboard.cuda.codec import CODEC_TILE, apply_patch_, encode_patch
from weftboard.proto.errors import WeftboardError
from weftboard.subscriber.destination import (
    TensorEntry,
    VersionTarget,
    require_transition,
)
from weftboard.subscriber.engines.vllm_live import LiveParams, Packer, StagedWrite
from weftboard.subscriber.engines.vllm_params import Unplaceable
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


def pack_cpu_kernel(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """vLLM's own CPU kernel preparation of a linear layer holding ``weight``: its ``cpu_linear``."""
    # vLLM is present only inside the engine's process; this module is imported outside it too
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(module, remove_weight=True)
    return module.cpu_linear


class WorkerWeights:
    """One worker's checkpoint-named copy of the served weights and what it last verified."""

    def __init__(self, tensors: dict[str, torch.Tensor], buffers: list[torch.Tensor], target: VersionTarget,
                 digests: dict[str, str]) -> None:
        self.tensors = tensors
        self.buffers = buffers  # the owned storage the tensors view
        self.version = target.version
        self.root = target.root_digest
        self.digests = digests


@dataclass
class StagedPatch:
    """A patch applied and verified on the shadow, not yet written into the model."""

    record: VersionTarget
    text: str  # the record as the island sent it: a commit names exactly this one
    thread: threading.Thread | None = None
    applied: AppliedPatch | None = None
    touched: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    write: StagedWrite | None = None
    refusal: tuple[str, str] | None = None  # (status, error) when it cannot be committed
    seconds: float = 0.0


class WeftboardWorkerExtension:
    """Mixed into vLLM's worker class; every public name starts with ``weftboard_``."""

    def weftboard_digest(self, deep: bool = False) -> dict[str, Any]:
        """The version and root this worker holds; ``deep`` also compares the live parameters with
        them (after a staging under way has settled). Not deep, it never waits: a staging patches
        the shadow's bytes, not the version and root it vouches for (the island's health probe)."""
        staged: StagedPatch | None = getattr(self, "weftboard_staged", None)
        if deep and staged is not None and staged.thread is not None:
            staged.thread.join()  # the shadow is being patched: wait until it is settled
        if deep and staged is not None and staged.applied is not None:
            return self._weftboard_answer("staging", f"a patch to version {staged.record.version} is staged; "
                                          "commit or drop it before a deep check", version=0, root=None)
        held: WorkerWeights | None = getattr(self, "weftboard_weights", None)
        if held is None:
            return self._weftboard_answer("ok", "", version=0, root=None)
        live: LiveParams | None = getattr(self, "weftboard_live", None)
        extra: dict[str, Any] = {"write_mode": "direct" if live is not None else "loader"}
        if deep and live is not None:
            bad = live.mismatches(held.tensors) + live.stale()
            if bad:
                return self._weftboard_answer("rejected", f"live parameters differ from version {held.version}: "
                                              f"{sorted(set(bad))[:5]}", version=0, root=None)
            extra["checked"] = len(live.placements)
        return self._weftboard_answer("ok", "", version=held.version, root=held.root, **extra)

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
        """Load a verified checkpoint folder whole into the model (vLLM's loader) and keep its bytes."""
        return self._weftboard_take_folder(checkpoint_dir, target, load=True)

    def weftboard_adopt(self, checkpoint_dir: str, target: str) -> dict[str, Any]:
        """After vLLM reloaded ``checkpoint_dir`` itself: keep its verified bytes as the shadow and
        bind the live parameters again (checked against what vLLM loaded)."""
        return self._weftboard_take_folder(checkpoint_dir, target, load=False)

    def weftboard_detach(self) -> dict[str, Any]:
        """Before vLLM reloads weights itself: nothing is vouched for until ``adopt`` or ``attach``."""
        self._weftboard_unbind()
        self.weftboard_weights = None
        self.weftboard_staged = None
        return self._weftboard_answer("ok", "", version=0)

    def weftboard_stage_patch(self, patch_path: str, target: str) -> dict[str, Any]:
        """Start applying and verifying a patch on the shadow in the background (the engine serves
        meanwhile); ``weftboard_commit`` writes it into the model."""
        self._weftboard_drop_staged()
        staged = StagedPatch(target_from_json(target), target)
        staged.thread = threading.Thread(target=self._weftboard_stage, args=(patch_path, staged),
                                         name="weftboard-stage", daemon=True)
        self.weftboard_staged = staged
        staged.thread.start()
        return self._weftboard_answer("staging", "", version=staged.record.version)

    def weftboard_stage_status(self) -> dict[str, Any]:
        """Whether the staging has finished (never waits: the engine keeps its steps going)."""
        staged: StagedPatch | None = getattr(self, "weftboard_staged", None)
        if staged is None:
            return self._weftboard_answer("needs_attach", "nothing is staged")
        if staged.thread is not None and staged.thread.is_alive():
            return self._weftboard_answer("staging", "", version=staged.record.version)
        if staged.refusal is not None:
            return self._weftboard_answer(*staged.refusal, version=staged.record.version - 1)
        elements = staged.write.elements if staged.write is not None else None
        return self._weftboard_answer("staged", "", version=staged.record.version, elements=elements,
                                      apply_s=staged.seconds)

    def weftboard_commit(self, target: str) -> dict[str, Any]:
        """Write the staged patch of ``target`` into the model (call it with the engine paused)."""
        record = target_from_json(target)
        staged: StagedPatch | None = getattr(self, "weftboard_staged", None)
        self.weftboard_staged = None
        held: WorkerWeights | None = getattr(self, "weftboard_weights", None)
        if staged is None or staged.text != target:
            if staged is not None:
                self.weftboard_staged = staged
                self._weftboard_drop_staged()
            version = 0 if held is None else held.version
            return self._weftboard_answer("needs_attach", f"nothing is staged for version {record.version}",
                                          version=version)
        if staged.thread is not None:
            staged.thread.join()
        return self._weftboard_commit(staged)

    def weftboard_apply_patch(self, patch_path: str, target: str) -> dict[str, Any]:
        """Apply one patch (``target.version - 1`` -> ``target.version``) to the live model at once."""
        staged = StagedPatch(target_from_json(target), target)
        self._weftboard_drop_staged()
        self._weftboard_stage(patch_path, staged)
        return self._weftboard_commit(staged)

    def weftboard_retie(self) -> dict[str, Any]:
        """Tie the output head to the input embedding again and redo its kernel preparation.

        vLLM's reload loads no weight into a tied ``lm_head`` (it shares the embedding's), so
        the copy its CPU kernels packed at start-up stays on the old version; after vLLM's own
        ``reload_weights`` the island calls this, after our loader hand-over we do."""
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

    # -- the steps -------------------------------------------------------------------------

    def _weftboard_take_folder(self, checkpoint_dir: str, target: str, *, load: bool) -> dict[str, Any]:
        record = target_from_json(target)
        t0 = time.perf_counter()
        self._weftboard_drop_staged()
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
        self._weftboard_unbind()
        if load:
            try:
                self._weftboard_install(tensors, list(tensors))
            except Exception as exc:  # noqa: BLE001 - vLLM's loaders raise anything; the island must hear it
                return self._weftboard_answer("install_failed", f"loading {checkpoint_dir}: {exc!r}", restored=False)
        why = self._weftboard_bind(tensors)
        if why.startswith("mismatch"):
            return self._weftboard_answer("install_failed", f"{checkpoint_dir}: {why}", restored=False)
        self.weftboard_weights = WorkerWeights(tensors, buffers, record, digests)
        return self._weftboard_answer("ok", "", version=record.version, root=record.root_digest,
                                      write_mode=self._weftboard_mode(), why_loader=why,
                                      seconds=time.perf_counter() - t0)

    def _weftboard_stage(self, patch_path: str, staged: StagedPatch) -> None:
        """Apply and verify on the shadow; find the elements to write. Runs in its own thread."""
        t0 = time.perf_counter()
        record = staged.record
        held: WorkerWeights | None = getattr(self, "weftboard_weights", None)
        if held is None or held.version != record.version - 1:
            version = 0 if held is None else held.version
            staged.refusal = ("needs_attach", f"this worker holds version {version}, the patch needs {record.version - 1}")
            return
        try:
            check_layout(held.tensors, record)
        except WeftboardError as exc:
            staged.refusal = ("layout", str(exc))
            return
        try:
            applied = apply_patch_(held.tensors, Path(patch_path).read_bytes())  # all or nothing
        except (WeftboardError, OSError) as exc:
            staged.refusal = ("rejected", f"patch {patch_path}: {exc}")
            return
        touched = [n for n, c in applied.changed.items() if c]
        try:
            require_transition(applied.base_version, applied.target_version, record)
            staged.digests = verify_tensors(held.tensors, record, rehash=touched, cache=held.digests)
        except WeftboardError as exc:
            applied.revert()
            staged.refusal = ("rejected", f"{exc}; reverted, the model was not touched")
            return
        staged.applied, staged.touched = applied, touched
        live: LiveParams | None = getattr(self, "weftboard_live", None)
        if live is not None:
            staged.write = live.stage(held.tensors, touched)
        staged.seconds = time.perf_counter() - t0

    def _weftboard_commit(self, staged: StagedPatch) -> dict[str, Any]:
        held: WorkerWeights | None = getattr(self, "weftboard_weights", None)
        version = 0 if held is None else held.version
        if staged.refusal is not None or held is None or staged.applied is None:
            status, error = staged.refusal or ("needs_attach", "the staging did not finish")
            return self._weftboard_answer(status, error, version=version)
        t0 = time.perf_counter()
        live: LiveParams | None = getattr(self, "weftboard_live", None)
        stale = live.stale() if live is not None else []
        if stale:
            staged.applied.revert()
            return self._weftboard_answer("needs_attach", f"vLLM replaced the parameters of {stale[:3]} since they "
                                          "were bound; reverted, the model was not touched", version=version)
        try:
            self._weftboard_write(held, staged, live)
        except Exception as exc:  # noqa: BLE001 - any failure must put the old bytes back
            staged.applied.revert()
            try:
                self._weftboard_restore(held, staged.touched, live)
            except Exception as again:  # noqa: BLE001
                self.weftboard_weights = None
                return self._weftboard_answer("install_failed", f"{exc!r}; restoring failed too: {again!r}",
                                              restored=False, version=0)
            return self._weftboard_answer("install_failed", f"{exc!r}; the previous bytes are back",
                                          restored=True, version=version)
        record = staged.record
        held.version, held.root, held.digests = record.version, record.root_digest, staged.digests
        return self._weftboard_answer("ok", "", version=record.version, root=record.root_digest,
                                      tensors=len(staged.touched), write_mode=self._weftboard_mode(),
                                      elements=staged.write.elements if staged.write is not None else None,
                                      apply_s=staged.seconds, install_s=time.perf_counter() - t0)

    def _weftboard_write(self, held: WorkerWeights, staged: StagedPatch, live: LiveParams | None) -> None:
        if live is not None and staged.write is not None:
            live.write(staged.write)
            return
        packed = getattr(self.model_runner.get_model(), "packed_modules_mapping", {}) or {}
        groups = module_groups(list(held.tensors), packed)
        changed = set(staged.touched)
        names = [n for g in groups.values() if not changed.isdisjoint(g) for n in g]
        self._weftboard_install(held.tensors, names)

    def _weftboard_restore(self, held: WorkerWeights, touched: list[str], live: LiveParams | None) -> None:
        """The shadow is back on the old bytes: put them back into the model too."""
        if live is not None:
            live.write(live.stage(held.tensors, touched))
        else:
            self._weftboard_install(held.tensors, touched)

    def _weftboard_bind(self, tensors: Mapping[str, torch.Tensor]) -> str:
        """Bind the live parameters for direct writes; ``""`` when bound, else why not."""
        model = self.model_runner.get_model()
        try:
            live = LiveParams.bind(model, tensors, self._weftboard_packer())
        except Unplaceable as exc:
            self.weftboard_live = None
            return f"loader: {exc}"
        bad = live.mismatches(tensors)
        if bad:
            self.weftboard_live = None
            return f"mismatch: the model does not hold the verified bytes of {bad[:3]}"
        self.weftboard_live = live
        return ""

    def _weftboard_unbind(self) -> None:
        """Forget the bound parameters (vLLM is about to load weights itself)."""
        self.weftboard_live = None

    def _weftboard_drop_staged(self) -> None:
        """A staging left behind (its commit never came) is undone before anything else."""
        staged: StagedPatch | None = getattr(self, "weftboard_staged", None)
        self.weftboard_staged = None
        if staged is None:
            return
        if staged.thread is not None:
            staged.thread.join()
        if staged.applied is not None:
            staged.applied.revert()

    def _weftboard_packer(self) -> Packer | None:
        """vLLM's CPU kernel preparation of one linear layer (None off CPU)."""
        if getattr(self, "device", torch.device("cpu")).type != "cpu":
            return None
        return pack_cpu_kernel

    def _weftboard_mode(self) -> str:
        return "direct" if getattr(self, "weftboard_live", None) is not None else "loader"

    def _weftboard_install(self, tensors: Mapping[str, torch.Tensor], names: list[str]) -> None:
        """Hand checkpoint tensors to the model's loader (vLLM's in-place layer-wise reload)."""
        self.reload_weights(weights_iterator=[(n, tensors[n]) for n in names], is_checkpoint_format=True)
        if any(n.endswith("embed_tokens.weight") for n in names):
            self.weftboard_retie()

    def _weftboard_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def _weftboard_answer(self, status: str, error: str, **fields: Any) -> dict[str, Any]:
        return {"status": status, "error": error, "rank": self._weftboard_rank(), **fields}
