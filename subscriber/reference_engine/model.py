"""The reference model: a tiny causal LM in plain torch, its tokenizer and config.

Invariants:
- ``forward`` is a pure function of a parameter mapping, so the trainer (fp32 masters,
  autograd) and the engine (bf16, inference) run the very same model.
- ``init_parameters`` is deterministic in ``config["seed"]``: the same bits on every machine;
  nothing is downloaded.
- Tensor names follow an HF llama-like layout, in a fixed order (``parameter_shapes``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from weftboard.proto.errors import InvalidArgument

EOS = "\x00"
_ALPHABET = EOS + " abcdefghijklmnopqrstuvwxyz0123456789.,!?:;'-\n"


class CharTokenizer:
    """One token per character of a fixed alphabet; unknown characters become '?'."""

    def __init__(self, alphabet: str = _ALPHABET) -> None:
        self.alphabet = alphabet
        self._index = {ch: i for i, ch in enumerate(alphabet)}
        self.eos_id = 0

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        unknown = self._index["?"]
        return [self._index.get(ch, unknown) for ch in text.lower()]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] for i in ids if i != self.eos_id)

    def token(self, token_id: int) -> str:
        return "" if token_id == self.eos_id else self.alphabet[token_id]


DEFAULT_CONFIG: dict[str, Any] = {
    "name": "weftboard-reference",
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "d_ff": 128,
    "max_seq": 128,
    "seed": 0,
}


def model_config(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    config = dict(DEFAULT_CONFIG)
    config.update(overrides or {})
    config["vocab_size"] = CharTokenizer().vocab_size
    if config["d_model"] % config["n_heads"]:
        raise InvalidArgument(f"d_model {config['d_model']} must be a multiple of n_heads {config['n_heads']}")
    return config


def parameter_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names (HF llama-like layout) and shapes, in a fixed order."""
    d, f, v = config["d_model"], config["d_ff"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, d),
        "model.embed_positions.weight": (config["max_seq"], d),
    }
    for i in range(config["n_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (d, d)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def init_parameters(config: Mapping[str, Any], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic initial weights from ``config['seed']`` (same bits on every machine)."""
    gen = torch.Generator().manual_seed(int(config["seed"]))
    params: dict[str, torch.Tensor] = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            std = 0.02 if "embed" in name else 1.0 / math.sqrt(shape[-1])
            t = torch.randn(shape, generator=gen) * std
        params[name] = t.to(dtype).contiguous()
    return params


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def forward(params: Mapping[str, torch.Tensor], ids: torch.Tensor, config: Mapping[str, Any]) -> torch.Tensor:
    """Logits (float32, [B, T, V]) for token ids [B, T]; params may be bf16 or fp32."""
    p = {k: v.float() for k, v in params.items()}
    b, t = ids.shape
    if t > config["max_seq"]:
        raise InvalidArgument(f"sequence of {t} tokens exceeds the model's max_seq {config['max_seq']}")
    h = config["n_heads"]
    x = p["model.embed_tokens.weight"][ids] + p["model.embed_positions.weight"][:t]
    for i in range(config["n_layers"]):
        pre = f"model.layers.{i}."
        y = _rms_norm(x, p[pre + "input_layernorm.weight"])
        q, k, v = (
            (y @ p[pre + f"self_attn.{n}_proj.weight"].T).view(b, t, h, -1).transpose(1, 2)
            for n in ("q", "k", "v")
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + att.transpose(1, 2).reshape(b, t, -1) @ p[pre + "self_attn.o_proj.weight"].T
        y = _rms_norm(x, p[pre + "post_attention_layernorm.weight"])
        gate = F.silu(y @ p[pre + "mlp.gate_proj.weight"].T)
        x = x + (gate * (y @ p[pre + "mlp.up_proj.weight"].T)) @ p[pre + "mlp.down_proj.weight"].T
    x = _rms_norm(x, p["model.norm.weight"])
    return x @ p["lm_head.weight"].T


def sequence_logprobs(
    params: Mapping[str, torch.Tensor], prompt_ids: list[int], completion_ids: list[int], config: Mapping[str, Any]
) -> torch.Tensor:
    """Log-probs of ``completion_ids`` given ``prompt_ids`` (differentiable for fp32 params)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = forward(params, ids[:, :-1], config)[0, len(prompt_ids) - 1 :]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1)
