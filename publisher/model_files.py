"""The trainer's side of a run's model files: the files of a Hugging Face model folder besides
the weights (config, generation config, tokenizer), declared and uploaded when the run is
created, so every island's checkpoint folder is a complete model folder; and opening that
run (``open_run``: get or create it, check its kind and files, upload the files).

``collect_model_files`` takes them from a directory (those of ``HF_MODEL_FILE_NAMES`` it
holds), a list of paths (each named by its base name; a directory in it counts as above), a
mapping ``{name in the folder: path}``, or objects with ``save_pretrained`` in such a list (a
transformers config, generation config, tokenizer or processor, such as the ``LlavaProcessor``
a vision-language trainer passes as ``processing_class``; not a model, whose weights it would
write).

Invariants:
- The files are read and hashed once, when the publisher is made, and the bytes hashed are
  the bytes uploaded: a file that changes on disk later changes nothing. Errors (a missing
  file, a weight file, too many bytes) surface there, naming the file.
- Of what ``save_pretrained`` writes, the files of ``HF_MODEL_FILE_NAMES`` are kept; any other
  file it wrote is dropped with a warning naming it (never silently).
- An existing run must be of the publisher's kind (``FailedPrecondition``) and carry the same
  files (``AlreadyExists`` naming the first difference, as the board's CreateRun says). A run
  without versions gets them uploaded (content addressed: uploading twice writes the same
  bytes); a run with versions has them already, since the board committed its version 1
  only with every one in the blob store.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import xxhash

from weftboard.board.blobs.transfer import Uploader, with_retries
from weftboard.proto import convert
from weftboard.proto.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from weftboard.proto.model_files import (
    HF_MODEL_FILE_NAMES,
    MAX_MODEL_FILES_BYTES,
    check_model_file_name,
    check_model_files,
    model_files_difference,
)
from weftboard.proto.names import blob_key, format_digest
from weftboard.proto.records import BlobRef
from weftboard.proto.v1 import board_pb2 as pb

log = structlog.get_logger("weftboard.publisher")
PathLike = str | os.PathLike
#: What ``Publisher(model_files=...)`` accepts (see the module docstring).
ModelFileSource = PathLike | Iterable[Any] | Mapping[str, PathLike] | None


@dataclass(frozen=True)
class ModelFile:
    """One model file as read: its name in the folder, its bytes and their digest."""

    name: str
    data: bytes
    digest: str

    def blob(self, run: str) -> BlobRef:
        return BlobRef(blob_key(run, self.digest), self.digest, len(self.data), name=self.name)

    def ref(self, run: str) -> pb.BlobRef:
        """The file as ``Run.model_files`` names it."""
        b = self.blob(run)
        return pb.BlobRef(key=b.key, digest=b.digest, size=b.size, name=b.name)


def _hf_files(directory: Path) -> dict[str, Path]:
    """The files of ``HF_MODEL_FILE_NAMES`` that ``directory`` holds, by name."""
    return {n: directory / n for n in HF_MODEL_FILE_NAMES if (directory / n).is_file()}


def _from_dir(directory: Path) -> dict[str, Path]:
    found = _hf_files(directory)
    if not found:
        raise InvalidArgument(f"model files: {directory} holds none of {', '.join(HF_MODEL_FILE_NAMES)}")
    return found


def _saved(obj: Any) -> dict[str, bytes]:
    """The model files an object with ``save_pretrained`` writes (a config, a tokenizer or a
    processor): those of ``HF_MODEL_FILE_NAMES``; any other file it wrote is logged as dropped."""
    with tempfile.TemporaryDirectory(prefix="weftboard-model-files-") as tmp:
        root = Path(tmp)
        obj.save_pretrained(tmp)
        kept = _hf_files(root)
        written = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        dropped = [n for n in written if n not in kept]
        if not kept:
            raise InvalidArgument(f"model files: {type(obj).__name__}.save_pretrained wrote none of "
                                  f"{', '.join(HF_MODEL_FILE_NAMES)} (it wrote {', '.join(written) or 'nothing'})")
        if dropped:
            log.warning("model files: save_pretrained wrote files weftboard does not carry; an island's "
                        "folder will lack them (pass them by path or mapping to keep them)",
                        source=type(obj).__name__, dropped=dropped, kept=sorted(kept))
        return {n: p.read_bytes() for n, p in kept.items()}


def _add(named: dict[str, Any], name: str, what: Any) -> None:
    if name in named:
        raise InvalidArgument(f"model files: two files are named {name!r}")
    named[name] = what


def collect_model_files(run: str, source: ModelFileSource) -> tuple[ModelFile, ...]:
    """Read and check the model files ``source`` names (see the module docstring), by name."""
    if source is None:
        return ()
    named: dict[str, Path | bytes] = {}
    if isinstance(source, Mapping):
        for name, path in source.items():
            _add(named, name, Path(path))
    else:
        items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
        for item in items:
            if isinstance(item, torch.nn.Module):
                raise InvalidArgument("model files: pass model.config and model.generation_config, not the model "
                                      "(saving the model would write its weights)")
            if hasattr(item, "save_pretrained"):
                for name, data in _saved(item).items():
                    _add(named, name, data)
            elif not isinstance(item, (str, os.PathLike)):
                raise InvalidArgument(f"model files: a {type(item).__name__} is neither a path nor a config or "
                                      "tokenizer with save_pretrained")
            elif Path(item).is_dir():
                for name, path in _from_dir(Path(item)).items():
                    _add(named, name, path)
            else:
                _add(named, name=Path(item).name, what=Path(item))
    files: list[ModelFile] = []
    total = 0
    for name, what in sorted(named.items()):
        check_model_file_name("model file name", name)  # before reading: never a weight file's gigabytes
        try:
            total += what.stat().st_size if isinstance(what, Path) else len(what)
            if total > MAX_MODEL_FILES_BYTES:
                raise InvalidArgument(f"model files: more than {MAX_MODEL_FILES_BYTES >> 20} MiB in all "
                                      f"(with {name!r}); the weights come from the run's versions")
            data = what.read_bytes() if isinstance(what, Path) else what
        except OSError as exc:
            raise InvalidArgument(f"model file {what}: {exc.strerror or exc}") from None
        files.append(ModelFile(name, data, format_digest(xxhash.xxh3_128(data).digest())))
    check_model_files(run, [f.blob(run) for f in files])
    return tuple(files)


async def open_run(client: Any, uploader: Uploader, wanted: pb.Run, files: tuple[ModelFile, ...]) -> pb.Run:
    """The run ``wanted`` names, created as ``wanted`` with ``files`` if it does not exist, of
    ``wanted``'s kind and with ``files``; the files uploaded while it has no version."""
    name = wanted.run
    try:
        run = await with_retries("GetRun", lambda: client.get_run(name))
    except NotFound:
        wanted.model_files.extend(f.ref(name) for f in files)
        run = await with_retries("CreateRun", lambda: client.create_run(wanted))
    if run.kind != wanted.kind:
        raise FailedPrecondition(f"run {name} is of kind {pb.RunKind.Name(run.kind)}, but this call publishes "
                                 f"{pb.RunKind.Name(wanted.kind)}")
    if not files:
        return run
    difference = model_files_difference(convert.model_files_from_pb(run), [f.blob(name) for f in files])
    if difference:
        raise AlreadyExists(f"run {name!r} exists with other model files: {difference}; a run's model files "
                            "are fixed when it is created: pick another run name")
    if run.head == 0:
        await asyncio.gather(*(uploader.upload(f.digest, len(f.data), data=f.data) for f in files))
    return run
