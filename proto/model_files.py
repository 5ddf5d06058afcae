"""A run's model files: the files of a Hugging Face model folder besides the weights.

A run may carry ``config.json``, ``generation_config.json`` and tokenizer files, fixed when
the run is created, so that an island's checkpoint folder is a complete model folder
(``vllm serve DIR``, ``AutoModelForCausalLM.from_pretrained(DIR)``). Each is a ``BlobRef``
whose ``name`` is the file's path in the folder, stored as a blob like every other.

Invariants (``check_model_files``):
- A name is a safe relative path: a file name, or one folder and a file name, each part
  1-128 characters of ``[A-Za-z0-9._+-]`` not starting with "." (so no "..", no absolute
  path, no hidden or temporary file); no name is also the folder of another.
- No weight file nor a folder named like one (``WEIGHT_SUFFIXES``, shard indexes) and not the
  island's own record (``weftboard.json``): the weights come from the versions, never from here.
- At most ``MAX_MODEL_FILES`` files and ``MAX_MODEL_FILES_BYTES`` in all, none empty, names
  distinct; each key is the content-addressed key of its digest in the run (like every blob).
- Two lists of model files are the same when they name the same files with the same
  digests and sizes, in any order (``model_files_difference``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from weftboard.proto.errors import InvalidArgument
from weftboard.proto.records import BlobRef, check_blob_ref

MAX_MODEL_FILES = 64
MAX_MODEL_FILES_BYTES = 64 << 20
# The non-weight files of a Hugging Face model folder that a publisher takes from a directory or
# from what save_pretrained writes (tokenizers, configs, processors). The board does not check
# names against it: any safe name (check_model_file_name) is a model file there.
HF_MODEL_FILE_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "added_tokens.json",
    "preprocessor_config.json",  # an image processor or feature extractor
    "processor_config.json",  # a multimodal processor (LlavaProcessor, ...): AutoProcessor needs it
    "video_preprocessor_config.json",
    "chat_template.json",  # a processor's chat template in the legacy format
    "adapter_config.json",  # a PEFT adapter's folder (a run of kind RUN_KIND_LORA_ADAPTER)
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")
RESERVED_NAMES = frozenset({"weftboard.json"})  # the island's record of the version it holds
_PART = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,127}")


def check_model_file_name(where: str, name: str) -> str:
    """A safe relative path of a non-weight file in a model folder (see the module docstring)."""
    parts = name.split("/")
    if len(parts) > 2 or not all(_PART.fullmatch(p) for p in parts):
        raise InvalidArgument(
            f"{where} {name!r} is not a safe relative file name: a file name, or one folder and a file "
            "name separated by '/', each 1-128 characters of [A-Za-z0-9._+-] not starting with '.'"
        )
    if any(p.lower().endswith(WEIGHT_SUFFIXES) for p in parts):
        raise InvalidArgument(
            f"{where} {name!r} is named as a weight file ({', '.join(WEIGHT_SUFFIXES)}); the weights come from "
            "the run's versions, model files are the rest of the folder (config, tokenizer)"
        )
    if name in RESERVED_NAMES:
        raise InvalidArgument(f"{where} {name!r} is the island's own record of its version; rename the file")
    return name


def check_model_files(run: str, files: Sequence[BlobRef]) -> None:
    """A run's model files as a publisher declares them (see the module docstring)."""
    if len(files) > MAX_MODEL_FILES:
        raise InvalidArgument(f"run.model_files has {len(files)} files; at most {MAX_MODEL_FILES}")
    names: set[str] = set()
    for i, f in enumerate(files):
        where = f"run.model_files[{i}]"
        check_model_file_name(f"{where}.name", f.name)
        if f.name in names:
            raise InvalidArgument(f"{where}.name {f.name!r} is given twice")
        names.add(f.name)
        check_blob_ref(where, run, f)
        if f.size <= 0:
            raise InvalidArgument(f"{where} ({f.name}) has size {f.size}; an empty file carries nothing, leave it out")
        if f.url:
            raise InvalidArgument(f"{where}.url must be empty; GetModelFiles presigns URLs")
    folders = {n.split("/")[0] for n in names if "/" in n}
    clash = sorted(folders & names)
    if clash:
        raise InvalidArgument(f"run.model_files names {clash[0]!r} both as a file and as a folder")
    total = sum(f.size for f in files)
    if total > MAX_MODEL_FILES_BYTES:
        raise InvalidArgument(
            f"run.model_files hold {total} bytes; at most {MAX_MODEL_FILES_BYTES} ({MAX_MODEL_FILES_BYTES >> 20} MiB)"
        )


def model_files_difference(have: Sequence[BlobRef], want: Sequence[BlobRef]) -> str:
    """How ``want`` differs from ``have`` (the first difference, by name), "" when they are the same."""
    old = {f.name: (f.digest, f.size) for f in have}
    new = {f.name: (f.digest, f.size) for f in want}
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            return f"{name!r} is missing (the run has it)"
        if name not in old:
            return f"{name!r} is new (the run does not have it)"
        if old[name] != new[name]:
            (d0, s0), (d1, s1) = old[name], new[name]
            return f"{name!r} is {s1} bytes with digest {d1}, the run's is {s0} bytes with digest {d0}"
    return ""
