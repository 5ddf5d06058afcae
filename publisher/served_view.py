"""The publisher's served view: the newest published version, as islands hold it.

The view is one tensor per served name (the run's layout), on the model's device. A read
projects each master tensor to its served form and folds it into the view (``fold``), which
also records the transition: per tensor a delta or, on a CPU view in the default or context
encoding, the tile scans that ``finish`` turns into the patch's streams (the compact encoding
folds with the default's scans, and ``finish`` encodes its 16-bit float tensors from a copy of
the previous version's bits, ``previous``, and the view). The snapshot then
hashes what changed and, for an anchor, writes the view as a safetensors checkpoint.

Invariants:
- After a read the view equals the version being published; nothing else writes it.
- ``digests`` holds the current digest of every view tensor hashed so far; a tensor a read
  changed is re-hashed before its digest is used (``hash_changed`` or ``snapshot``).
- Whatever reads the view for a version (finish, hashing, anchor files) runs before the next
  read changes it: the publisher runs reads and snapshots on one thread, in publish order.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from weftboard.cuda import codec, context_codec
from weftboard.cuda.anchors import write_checkpoint
from weftboard.cuda.diff import TensorDelta
from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.cuda.formats import Projector
from weftboard.cuda.jit import serial_kernels
from weftboard.proto.errors import FailedPrecondition, InvalidArgument
from weftboard.publisher.fold import TensorScan, chunked_cast_fold_, fold_pieces_
from weftboard.publisher.job import Job
from weftboard.publisher.model_state import module_state
from weftboard.publisher.parts import PartCutter

LayoutEntry = tuple[str, str, tuple[int, ...]]  # (served name, dtype name, shape)


def master_state(model_or_state: Any) -> dict[str, torch.Tensor]:
    """The master tensors of an ``nn.Module`` or a state dict (detached, not copied).

    A module gives its served weights (``model_state.module_state``): unwrapped from
    ``torch.compile`` / DDP, PEFT adapters merged (new tensors), tied weights once. A state
    dict is taken as it is, every name kept."""
    if isinstance(model_or_state, torch.nn.Module):
        return {k: v.detach() for k, v in module_state(model_or_state).items()}
    if isinstance(model_or_state, Mapping):
        return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in model_or_state.items()}
    raise InvalidArgument(f"publish() takes an nn.Module or a state dict, not {type(model_or_state).__name__}")


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _load_libc()


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, and the trainer
    process would carry the publisher's transient buffers, such as a read's, as resident memory)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def changed_elements(item: Any) -> int:
    """How many elements a fold changed: a TensorDelta's, or a tensor's scans'."""
    return item.changed if isinstance(item, TensorDelta) else codec.scans_changed(item)


class ServedView:
    def __init__(self, run: str, projector: Projector, encoding: str, hash_pool: concurrent.futures.Executor) -> None:
        self.run = run
        self.projector = projector
        self.encoding = encoding
        self.hash_pool = hash_pool  # xxh3 releases the GIL: hashing runs on the pool's threads
        self.layout: list[LayoutEntry] = []
        self.tensors: dict[str, torch.Tensor] | None = None
        self.digests: dict[str, str] = {}
        self.has_base = False  # the view holds a version islands hold (a patch can be made from it)
        # The compact encoding codes a tensor against its old bits, which the fold overwrites in
        # the view: a copy of the view's 16-bit float CPU tensors (``keep_previous``), one
        # version behind from a fold until ``catch_up_previous``.
        self.previous: dict[str, torch.Tensor] | None = None
        self._scratch: dict = {}

    def names(self) -> list[str]:
        return [n for n, _, _ in self.layout]

    def stored_bytes(self) -> int:
        """The size of one full anchor of this layout."""
        return sum(math.prod(s) * torch.empty((), dtype=getattr(torch, d)).element_size() for _, d, s in self.layout)

    def reset(self, tensors: dict[str, torch.Tensor] | None, digests: dict[str, str]) -> None:
        """Take ``tensors`` (a resumed head, or None: no base) as the view."""
        self.tensors, self.digests, self.has_base = tensors, digests, tensors is not None
        self.keep_previous()
        if tensors is not None:
            self.projector.resume_from(tensors)

    def keep_previous(self) -> None:
        """For the compact encoding, copy the view's 16-bit float CPU tensors into ``previous``."""
        self.previous = None
        if self.encoding == "compact" and self.tensors is not None:
            self.previous = {n: t.clone() for n, t in self.tensors.items()
                             if t.device.type == "cpu" and context_codec.supports(t.dtype)}

    def check_layout(self, layout: list[LayoutEntry]) -> None:
        ours = [(n, d, tuple(s)) for n, d, s in layout]
        if ours == self.layout:
            return
        theirs = {n: (d, s) for n, d, s in self.layout}
        mine = {n: (d, s) for n, d, s in ours}
        details = [f"{n}: run has {theirs.get(n, 'nothing')}, model gives {mine.get(n, 'nothing')}"
                   for n in sorted(set(theirs) | set(mine)) if theirs.get(n) != mine.get(n)]
        if not details:
            details.append("same tensors in a different order")
        raise FailedPrecondition(
            f"the model's served layout differs from run {self.run}'s layout ({len(details)} differences; first: "
            + "; ".join(details[:3]) + "). Publish it to a new run."
        )

    # -- the read: project and fold --------------------------------------------------------

    def fold(self, master: dict[str, torch.Tensor], *, anchor: bool, scan: bool = False,
             on_scanned: Callable[[str, Any], None] | None = None) -> dict[str, Any] | None:
        """Project every master tensor and fold it into the view; per served tensor its delta
        or (``scan``, CPU views) its scans, or None when there was no view yet.
        ``on_scanned(name, scans)`` sees each tensor's scans as soon as it is folded."""
        if self.tensors is None:
            view: dict[str, torch.Tensor] = {}
            for name, t in master.items():
                for sname, st in self.projector.project_tensor(name, t, anchor=True).items():
                    if st.data_ptr() == t.data_ptr():  # the projection aliases the trainer's tensor
                        st = st.clone()
                    view[sname] = st.contiguous()
            self.check_layout([(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in view.items()])
            self.tensors, self.digests = view, {}
            self.keep_previous()
            return None
        folded: dict[str, Any] = {}
        for name, t in master.items():
            prev = self.tensors.get(name)
            if self._is_elementwise(name, t, prev):
                folded[name] = chunked_cast_fold_(prev, t, self._scratch, self._tensor_scan(prev, scan))
                if on_scanned is not None and not isinstance(folded[name], TensorDelta):
                    on_scanned(name, folded[name])
                continue
            for sname, st in self.projector.project_tensor(name, t, anchor=anchor).items():
                prev = self.tensors.get(sname)
                if prev is None or prev.shape != st.shape or prev.dtype != st.dtype:
                    raise FailedPrecondition(
                        f"tensor {sname!r} projects to {tuple(st.shape)} {st.dtype}, but the run's layout has "
                        f"{None if prev is None else (tuple(prev.shape), prev.dtype)}"
                    )
                folded[sname] = fold_pieces_(prev, st.contiguous(), self._scratch, self._tensor_scan(prev, scan),
                                             len(st.reshape(-1)))
                if on_scanned is not None and not isinstance(folded[sname], TensorDelta):
                    on_scanned(sname, folded[sname])
        self._scratch.clear()
        if len(folded) != len(self.tensors):
            missing = sorted(set(self.tensors) - set(folded))[:3]
            raise FailedPrecondition(f"the model no longer produces served tensors {missing} of run {self.run}")
        return folded

    def _tensor_scan(self, prev: torch.Tensor | None, scan: bool) -> TensorScan | None:
        return TensorScan.for_tensor(self.encoding, prev) if scan and prev is not None else None

    def _is_elementwise(self, name: str, master: torch.Tensor, prev: torch.Tensor | None) -> bool:
        """Whether this tensor's served form is a plain elementwise cast of the master (so it
        can be projected in chunks without a full-size temporary)."""
        if prev is None or not master.is_contiguous() or master.device != prev.device:
            return False
        plan = self.projector.plan(name, tuple(master.shape), master.dtype)
        return (len(plan) == 1 and plan[0][0] == name and tuple(plan[0][2]) == tuple(master.shape)
                and plan[0][1] == str(prev.dtype).removeprefix("torch.") and prev.is_contiguous())

    # -- after the read, while the view holds this version --------------------------------

    def encode_scanned(self, name: str, scans: Any) -> Any:
        """The stream of a tensor from its fold's scans, or None when they make none (its
        delta then comes from the view, ``finish``). Reads the scans only, not the view."""
        t = self.tensors[name]  # type: ignore[index]
        return codec.encoded_from_scans(name, t.dtype, t.numel(), scans)

    def finish(self, folded: dict[str, Any], cutter: PartCutter | None = None,
               compact: bool = False, ahead: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(deltas, streams) from a fold: scanned tensors get their streams here (a tensor whose
        scans cannot make a stream gets its delta back from the view). Each stream goes to
        ``cutter`` as soon as it is finished, the tensors with the most changes first, so the
        bulk of the bytes ships early and the last part, cut just before the commit, is small.

        ``compact`` (the compact encoding's read): the changed tensors kept in ``previous`` are
        encoded from (``previous``, view) instead, each stream carrying its fold's scans (or
        keeping its delta) for a merge. ``catch_up_previous`` then gives it the view's bits.

        ``ahead``: the streams (or None) of tensors already encoded during the read
        (``parts.FinishAhead``), already handed to ``cutter``."""
        assert self.tensors is not None
        view = self.tensors
        previous = self.previous or {}
        by_changes = sorted(folded.items(), key=lambda entry: -changed_elements(entry[1]))
        pairs = [(n, previous[n], view[n]) for n, item in by_changes if compact and n in previous and changed_elements(item)]
        paired = {n for n, _, _ in pairs}
        ahead = ahead or {}
        scanned = [(n, item) for n, item in by_changes if not isinstance(item, TensorDelta) and n not in paired]
        deltas = {n: d for n, d in folded.items() if isinstance(d, TensorDelta)}
        fused: dict[str, Any] = {}
        # One thread with serial kernels: this runs while the trainer's next step keeps the
        # cores busy, where parallel regions wait at barriers for threads parked behind it.
        with serial_kernels():
            for enc in codec.encode_pairs(pairs, encoding="compact"):
                item = folded[enc.name]
                fused[enc.name] = enc if isinstance(item, TensorDelta) else dataclasses.replace(enc, scans=item)
                if cutter is not None:
                    cutter.add(enc)
            for name, scans in scanned:
                shipped = name in ahead
                enc = ahead[name] if shipped else self.encode_scanned(name, scans)
                if enc is None:
                    deltas[name] = codec.delta_from_scans(scans, view[name])
                else:
                    fused[name] = enc
                    if cutter is not None and not shipped:
                        cutter.add(enc)
        if cutter is not None:
            cutter.flush()
        return deltas, fused

    def catch_up_previous(self, folded: dict[str, Any]) -> None:
        """Copy what a fold changed into ``previous`` (the compact encoding), once its finish
        is done and its job queued: the commit need not wait for it, the next read does."""
        if self.previous is None:
            return
        for name, item in folded.items():
            if name in self.previous and changed_elements(item):
                self.previous[name].copy_(self.tensors[name])

    def hash_changed(self, folded: dict[str, Any]) -> dict[str, concurrent.futures.Future]:
        """Start hashing every view tensor the fold changed or that was never hashed."""
        assert self.tensors is not None
        view = self.tensors
        return {n: self.hash_pool.submit(tensor_digest, view[n]) for n, item in folded.items()
                if changed_elements(item) or n not in self.digests}

    def deltas_of(self, fused: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
        """``known`` deltas, with those of the streams encoded during a read (or a compact
        finish, from the scans they carry) whose tensors have none, while the view holds
        their version."""
        assert self.tensors is not None
        return dict(known, **{n: codec.delta_from_encoded(e, self.tensors[n]) for n, e in fused.items() if n not in known})

    def snapshot(self, job: Job, work_dir: Path, shard_bytes: int) -> None:
        """The job's tensor digests and root digest, and for an anchor its checkpoint files.

        An adapter job carries its own tensors (hashed afresh); a weights job reads the view.
        """
        tensors = job.adapter_tensors if job.adapter_tensors is not None else self.tensors
        assert tensors is not None
        cache = {} if job.adapter_tensors is not None else self.digests
        names = self.names()
        t_snap = time.perf_counter()
        todo = [n for n in names if n in job.touched or n not in cache]
        cache.update(zip(todo, self.hash_pool.map(lambda n: tensor_digest(tensors[n]), todo), strict=True))
        job.timings["digest_s"] = time.perf_counter() - t_snap
        job.digests = {n: cache[n] for n in names}
        job.root = root_digest([(n, d, list(s), job.digests[n]) for n, d, s in self.layout])
        if job.anchor:
            job.anchor_dir = work_dir / f"anchor-v{job.version}-{time.monotonic_ns()}"
            job.anchor_files = write_checkpoint(
                job.anchor_dir,
                [(n, tensors[n]) for n in names],
                shard_bytes=shard_bytes,
                metadata={"format": "pt", "weftboard_run": self.run, "weftboard_version": str(job.version)},
            )
        job.adapter_tensors = None
