"""A destination that keeps the served weights as an HF safetensors checkpoint directory.

Layout under ``root``::

    root/current -> versions/vN          (a relative symlink; engines load root/current;
                                          versions/vN-<ns> when the held version was rebuilt)
    root/versions/vN/model.safetensors   (or model-0000i-of-0000K.safetensors + index json)
    root/versions/vN/weftboard.json      (version, root digest, tensor digests, model file digests)
    root/versions/vN/config.json, ...    (the run's model files: config, tokenizer)
    root/model_files/config.json, ...    (their verified copies, from which each version gets them)
    root/quarantine/vN-<ns>/             (a version the scrub found damaged, with quarantined.txt)

Invariants:
- A version is built aside (``versions/.tmp-vN-*``), verified (every tensor digest and the
  root digest against the record), fsynced (files and directories), renamed to
  ``versions/vN``, and only then published by atomically replacing ``current`` (rename of
  a temporary symlink over it). A crash at any point leaves ``current`` on a complete,
  verified version: never a torn checkpoint.
- At start-up nothing on disk is trusted: what ``current`` points to is re-hashed and
  compared with its ``weftboard.json`` before ``held_version()`` reports it; leftover
  temporary directories from a crash are removed.
- Older versions are pruned after the swap, keeping the newest ``keep`` (>= 1). The held
  version can be loaded again (the subscriber's last resort, an anchor, may be the version
  it holds, whose copy on disk proved damaged): it is built beside the held copy under a
  name of its own and swapped in like any other, and the old copy pruned.
- ``apply_patch_arriving`` patches the in-memory copy while the patch downloads; nothing is
  written aside before the fetcher has verified the blob's digest.
- ``before_swap(tmp)`` (tests) runs after the new version is written and verified aside,
  before it is renamed and swapped in: where a crash must leave ``current`` untouched.
- ``quarantine`` (the scrub found the held version damaged) removes ``current`` first, then
  moves the folder aside: from then on nothing is held (the next step is an anchor).
- Model files (``hold_model_files``): every copy is written under a temporary name, hashed,
  and renamed into place only when it matches the run's digest, never otherwise. A version
  built aside gets them before its swap; the held version gets the ones it lacks in place,
  each appearing whole (a rename), its weights untouched. So ``current`` is a complete
  Hugging Face model folder once the run's files are held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from weftboard.cuda.anchors import (
    checkpoint_files,
    file_digest,
    load_safetensors_buffer,
    map_safetensors,
    read_header,
    write_index,
)
from weftboard.cuda.codec import apply_patch_, apply_patch_arriving_
from weftboard.proto.errors import (
    ApplyError,
    CorruptData,
    DigestMismatch,
    WeftboardError,
)
from weftboard.proto.records import BlobRef
from weftboard.subscriber.arriving import ArrivingApplier, ArrivingBytes
from weftboard.subscriber.cancel import thread_to_the_end
from weftboard.subscriber.destination import (
    Capabilities,
    TensorEntry,
    VersionTarget,
    require_parent,
    require_transition,
)
from weftboard.subscriber.verify import verify_tensors

log = structlog.get_logger("weftboard.subscriber")

META_NAME = "weftboard.json"
MODEL_FILES = "model_files"  # under the root: the verified copies of the run's model files
QUARANTINE = "quarantine"  # under the root: versions the scrub found damaged, moved aside
QUARANTINE_KEEP = 2


def _dir_version(name: str) -> int | None:
    """The version a ``versions/`` entry holds: ``vN``, or ``vN-<ns>`` for a reloaded held version."""
    head, _, tail = name.partition("-")
    if head[:1] == "v" and head[1:].isdigit() and (not tail or tail.isdigit()):
        return int(head[1:])
    return None


def _verified(path: Path, file: BlobRef) -> bool:
    """Whether ``path`` holds exactly the bytes of model file ``file``."""
    try:
        return path.stat().st_size == file.size and file_digest(path) == file.digest
    except OSError:  # absent, or a folder
        return False


def _drop_temporaries(folder: Path) -> None:
    """Remove the ``.tmp-*`` files a crash left while placing model files (one folder level down too)."""
    for pattern in (".tmp-*", "*/.tmp-*"):
        for stale in folder.glob(pattern):
            if stale.is_file():
                stale.unlink(missing_ok=True)


def _read_record(directory: Path) -> VersionTarget:
    """The version record a version's folder was written with (``META_NAME``)."""
    meta = json.loads((directory / META_NAME).read_text())
    return VersionTarget(
        version=int(meta["version"]),
        root_digest=meta["root_digest"],
        tensor_digests=meta["tensor_digests"],
        layout=[TensorEntry(n, d, tuple(s)) for n, d, s in meta["layout"]],
        labels=meta.get("labels", {}),
    )


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename is durable only then), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Mapped:
    """The tensors of every safetensors file of a directory, mapped in place."""

    def __init__(self, directory: Path, *, writable: bool) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._maps = []
        for path in checkpoint_files(directory):
            tensors, mm = map_safetensors(path, writable=writable)
            self._maps.append(mm)
            dup = set(self.tensors) & set(tensors)
            if dup:
                raise CorruptData(f"{directory}: tensors {sorted(dup)[:3]} appear in more than one shard")
            self.tensors.update(tensors)

    def flush(self) -> None:
        for mm in self._maps:
            mm.flush()

    def close(self) -> None:
        self.tensors.clear()
        for mm in self._maps:
            with contextlib.suppress(BufferError):
                mm.close()

    def __enter__(self) -> _Mapped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CheckpointDirDestination:
    capabilities = Capabilities(applies_while_arriving=True, weights_in_memory=False, activates_engine=False,
                                holds_model_files=True)

    def __init__(self, root: Path | str, *, keep: int = 2, verify: bool = True,
                 before_swap: Callable[[Path], None] | None = None) -> None:
        self.root = Path(root)
        self.keep = max(1, keep)
        self.before_swap = before_swap  # tests: a crash or a hang between verify and swap
        (self.root / "versions").mkdir(parents=True, exist_ok=True)
        self._held = 0
        self._digests: dict[str, str] = {}
        self._model_files: tuple[BlobRef, ...] = ()  # the run's, once the subscriber told them
        self._lock = asyncio.Lock()
        self._arriving = ArrivingApplier()  # apply_patch_arriving's thread
        for stale in (self.root / "versions").glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for link in self.root.glob(".current-*"):  # a swap's new link, left by a crash before its rename
            link.unlink(missing_ok=True)
        _drop_temporaries(self.root / MODEL_FILES)
        if self.current.exists():
            _drop_temporaries(self.current.resolve())
        if verify:
            self._recover()

    # -- the Destination protocol ----------------------------------------------------------

    def held_version(self) -> int:
        return self._held

    def _holding(self, version: int) -> Callable[[dict[str, str]], None]:
        """What records a finished load or apply: its digests, and ``version`` as held."""
        def hold(digests: dict[str, str]) -> None:
            self._digests, self._held = digests, version
        return hold

    @property
    def current(self) -> Path:
        return self.root / "current"

    def current_dir(self) -> Path | None:
        return self.current.resolve() if self._held else None

    async def held_target(self) -> VersionTarget | None:
        """The stored record (``weftboard.json``) of the held version, read on a worker thread
        (``HoldsTarget``: an engine loads the folder as that version), else None."""
        async with self._lock:  # no swap meanwhile: the record is the held version's
            if not self._held:
                return None
            directory = self.current.resolve()
            try:
                target = await asyncio.to_thread(_read_record, directory)
            except (OSError, ValueError, KeyError) as exc:
                raise CorruptData(f"the record of version {self._held} in {directory} cannot be read: {exc}") from exc
            if target.version != self._held:
                raise CorruptData(f"{directory} holds version {self._held} but its record says {target.version}")
            return target

    async def load_anchor(self, shards: Sequence[Path], target: VersionTarget) -> None:
        async with self._lock:
            await thread_to_the_end(self._load_anchor, list(shards), target, then=self._holding(target.version))

    async def apply_patch(self, patch: Path, target: VersionTarget) -> None:
        async with self._lock:
            require_parent(self._held, target, str(self.root))
            await thread_to_the_end(self._apply_patch, patch, target, then=self._holding(target.version))

    async def apply_patch_arriving(self, parts: Sequence[ArrivingBytes], target: VersionTarget) -> None:
        """Apply a patch while its parts download: the held version is read into memory and
        each tensor patched as its stream arrives; the new version is written aside and swapped
        in only after the fetcher verified every part's digest and the result verified."""
        async with self._lock:
            require_parent(self._held, target, str(self.root))
            digests = await self._arriving.run(parts, self._apply_patch_arriving, parts, target,
                                               what=f"applying version {target.version} in {self.root}")
            self._digests, self._held = digests, target.version

    async def close(self) -> None:
        """End the apply thread of patches applied while they arrive (made again when needed)."""
        async with self._lock:
            await self._arriving.close()

    async def verify_held(self, target: VersionTarget) -> bool:
        """The scrub (``scrub.py``): every tensor of the held version on disk re-hashed against
        ``target``; False when another version is held, ``CorruptData`` when it is damaged."""
        async with self._lock:
            if self._held != target.version:
                return False
            self._digests = await asyncio.to_thread(self._verify_held, target)
            return True

    async def quarantine(self, version: int, reason: str) -> bool:
        """Stop serving ``version`` (found damaged): ``current`` is removed, the version's folder
        moved under ``quarantine/`` (the newest ``QUARANTINE_KEEP`` stay for a look) and nothing
        is held; False when another version is held."""
        async with self._lock:
            if self._held != version:
                return False
            def dropped(aside: Path) -> None:
                self._held, self._digests = 0, {}
                log.error("checkpoint quarantined: nothing is held until it is fetched again", version=version,
                          moved_to=str(aside), reason=reason)

            await thread_to_the_end(self._quarantine, reason, then=dropped)
            return True

    async def missing_model_files(self, files: Sequence[BlobRef]) -> list[str]:
        """The names of ``files`` without a verified copy under ``root/model_files`` (re-hashed:
        nothing on disk is trusted)."""
        store = self.root / MODEL_FILES
        return await asyncio.to_thread(lambda: [f.name for f in files if not _verified(store / f.name, f)])

    async def hold_model_files(self, files: Sequence[BlobRef], fetched: Mapping[str, Path]) -> None:
        """Keep ``files`` from now on: the fetched ones copied to ``root/model_files`` (verified),
        then placed in the held version's folder where it lacks them, and in every version built
        from now on."""
        async with self._lock:
            await asyncio.to_thread(self._hold_model_files, tuple(files), dict(fetched))

    # -- work (worker threads) -------------------------------------------------------------

    def _hold_model_files(self, files: tuple[BlobRef, ...], fetched: dict[str, Path]) -> None:
        store = self.root / MODEL_FILES
        for f in files:
            if f.name in fetched:
                self._place(fetched[f.name], store / f.name, f)
            elif not _verified(store / f.name, f):
                raise CorruptData(f"model file {f.name!r}: {store} holds no verified copy and none was fetched")
        self._model_files = files
        if self._held:
            self._place_model_files(self.current.resolve())

    def _place_model_files(self, folder: Path) -> None:
        """Every model file of the run into ``folder`` (a version), where it lacks a verified copy."""
        for f in self._model_files:
            if not _verified(folder / f.name, f):
                self._place(self.root / MODEL_FILES / f.name, folder / f.name, f)

    @staticmethod
    def _place(src: Path, dest: Path, file: BlobRef) -> None:
        """Copy ``src`` to ``dest`` through a temporary file that becomes ``dest`` only if it
        holds exactly ``file``'s bytes (``DigestMismatch`` otherwise, nothing written)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            shutil.copyfile(src, tmp)
            _fsync(tmp)
            if not _verified(tmp, file):
                raise DigestMismatch(f"model file {file.name!r}: the copy from {src} is not the run's "
                                     f"{file.size} bytes with digest {file.digest}; not written")
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync(dest.parent)

    def _verify_held(self, target: VersionTarget) -> dict[str, str]:
        directory = self.current.resolve()
        try:
            with _Mapped(directory, writable=False) as mapped:
                return verify_tensors(mapped.tensors, target)
        except OSError as exc:  # a file gone or unreadable is damage too
            raise CorruptData(f"version {target.version} in {directory} cannot be read: {exc}") from exc

    def _quarantine(self, reason: str) -> Path:
        directory = self.current.resolve()
        aside = self.root / QUARANTINE / f"{directory.name}-{time.time_ns()}"
        aside.parent.mkdir(exist_ok=True)
        self.current.unlink()  # first: nobody loads it from now on
        _fsync(self.root)
        os.rename(directory, aside)
        (aside / "quarantined.txt").write_text(reason + "\n")
        kept = sorted(aside.parent.iterdir(), key=lambda d: d.stat().st_mtime_ns)  # its note was written last
        for old in kept[:-QUARANTINE_KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        return aside

    def _tmp_dir(self, version: int) -> Path:
        tmp = self.root / "versions" / f".tmp-v{version}-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir(parents=True)
        return tmp

    def _load_anchor(self, shards: list[Path], target: VersionTarget) -> dict[str, str]:
        tmp = self._tmp_dir(target.version)
        try:
            names = []
            for src in shards:
                dest = tmp / src.name
                try:
                    os.link(src, dest)  # same filesystem: no copy; the cache entry is deleted later
                except OSError:
                    shutil.copyfile(src, dest)
                names.append(src.name)
            self._place_model_files(tmp)
            if len(names) > 1:
                files = [(n, list(read_header(tmp / n)[1])) for n in names]
                total = sum(
                    info["data_offsets"][1] - info["data_offsets"][0]
                    for n in names for info in read_header(tmp / n)[1].values()
                )
                write_index(tmp, files, total)
            with _Mapped(tmp, writable=False) as mapped:
                digests = verify_tensors(mapped.tensors, target)
            self._activate(tmp, target, digests)
            return digests
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _apply_patch(self, patch: Path, target: VersionTarget) -> dict[str, str]:
        data = patch.read_bytes()
        return self._patched_copy(target, lambda tensors: apply_patch_(tensors, data))

    def _apply_patch_arriving(self, parts: Sequence[ArrivingBytes], target: VersionTarget) -> dict[str, str]:
        def apply(tensors: dict[str, torch.Tensor]) -> Any:
            applied = apply_patch_arriving_(tensors, parts)
            for blob in parts:
                blob.wait_verified()  # each whole part hashed to its record before the result counts
            return applied

        return self._patched_copy(target, apply)

    def _patched_copy(self, target: VersionTarget, apply: Callable[[dict[str, torch.Tensor]], Any]) -> dict[str, str]:
        """The held version patched by ``apply`` in memory (apply), verified (verify), written
        aside and swapped in (activate)."""
        src = self.current.resolve()
        tmp = self._tmp_dir(target.version)
        try:
            # Read the held version into memory, patch it there (scattered writes to a mapped
            # file fault page by page), verify, then write the new files out sequentially.
            buffers: list[tuple[str, torch.Tensor]] = []
            tensors: dict[str, torch.Tensor] = {}
            for f in checkpoint_files(src):
                part, buf = load_safetensors_buffer(f)
                tensors.update(part)
                buffers.append((f.name, buf))
            model_files = {f.name.split("/")[0] for f in self._model_files}
            for f in src.iterdir():
                if f.is_file() and f.suffix != ".safetensors" and f.name not in (META_NAME, *model_files):
                    shutil.copyfile(f, tmp / f.name)  # the shard index
            self._place_model_files(tmp)
            applied = apply(tensors)
            require_transition(applied.base_version, applied.target_version, target)
            touched = [n for n, c in applied.changed.items() if c]
            digests = verify_tensors(tensors, target, rehash=touched, cache=self._digests)
            tensors.clear()
            for name, buf in buffers:
                with open(tmp / name, "wb") as out:
                    out.write(memoryview(buf.numpy()))
            buffers.clear()
            self._activate(tmp, target, digests)
            return digests
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, WeftboardError) or not isinstance(exc, Exception):
                raise
            raise ApplyError(f"applying the patch to version {target.version} in {self.root} failed: {exc}") from exc

    def _activate(self, tmp: Path, target: VersionTarget, digests: dict[str, str]) -> None:
        """Make the verified version built in ``tmp`` the held one: its record written, every
        file fsynced, renamed to ``versions/vN``, ``current`` swapped to it atomically."""
        meta = {
            "version": target.version,
            "root_digest": target.root_digest,
            "tensor_digests": digests,
            "layout": [[e.name, e.dtype, list(e.shape)] for e in target.layout],
            "labels": dict(target.labels),
            "model_files": {f.name: f.digest for f in self._model_files},
        }
        (tmp / META_NAME).write_text(json.dumps(meta))
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        final = self.root / "versions" / f"v{target.version}"
        held = self.current.resolve() if self.current.exists() else None
        if held is not None and _dir_version(held.name) == target.version:
            # The held version itself again (an anchor reloaded over a damaged copy): built
            # beside it under a name of its own, swapped in, and the old copy pruned after.
            final = final.with_name(f"{final.name}-{time.monotonic_ns()}")
        elif final.exists():  # a leftover of an earlier attempt that never became current
            shutil.rmtree(final)
        if self.before_swap is not None:
            self.before_swap(tmp)
        os.rename(tmp, final)
        _fsync(final.parent)
        link_tmp = self.root / f".current-{os.getpid()}-{time.monotonic_ns()}"
        os.symlink(os.path.join("versions", final.name), link_tmp)
        os.replace(link_tmp, self.current)
        _fsync(self.root)
        self._prune(final)

    def _prune(self, current: Path) -> None:
        """Keep ``current`` and the newest ``keep - 1`` other versions; a replaced copy of the
        current version goes too."""
        version = _dir_version(current.name)
        others = []
        for d in (self.root / "versions").iterdir():
            v = _dir_version(d.name)
            if v is not None and d.name != current.name:
                others.append((v, d))
        older = sorted((o for o in others if o[0] != version), key=lambda o: o[0], reverse=True)
        for _, d in older[self.keep - 1:] + [o for o in others if o[0] == version]:
            shutil.rmtree(d, ignore_errors=True)

    # -- start-up --------------------------------------------------------------------------

    def _recover(self) -> None:
        """Trust what ``current`` holds only after re-hashing it against its own record."""
        if not self.current.exists():
            return
        directory = self.current.resolve()
        try:
            target = _read_record(directory)
            with _Mapped(directory, writable=False) as mapped:
                self._digests = verify_tensors(mapped.tensors, target)
            self._held = target.version
            log.info("verified the checkpoint on disk", root=str(self.root), version=self._held)
        except (OSError, ValueError, KeyError, WeftboardError) as exc:
            log.error("the checkpoint on disk does not verify; starting from nothing", root=str(self.root), error=str(exc))
            self._held, self._digests = 0, {}
