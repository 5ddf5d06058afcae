"""The weights a publisher reads from an ``nn.Module``: the tensors an engine loads, under the
names ``save_pretrained`` (or PEFT's ``merge_and_unload``) would give them.

- Wrappers are removed: ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``), and the
  ``module`` of ``DistributedDataParallel`` / ``DataParallel`` (``unwrap``).
- A PEFT model publishes its merged weights under the base model's names, computed beside the
  training model, which is never modified: a LoRA layer's ``base_layer`` weight with the delta
  (``get_delta_weight``) of each active adapter added in turn, in the weight's dtype, as peft's
  ``merge`` does (``weight += delta``; an ``Embedding``'s delta cast to the weight's dtype first),
  so a bf16 weight is rounded once per adapter and the bytes are ``merge_and_unload``'s; a
  ``modules_to_save`` wrapper its active copy; adapter-only tensors are dropped. Whatever
  cannot be merged exactly this way (DoRA and other LoRA variants, LoRA biases, quantized or
  sharded base layers, non-LoRA tuners, prompt learning, stacked adapters) raises
  ``InvalidArgument`` naming the module: wrong weights are never published.
- A tensor under several names (tied weights) is published once, under its first name
  (``drop_aliases``), as ``save_pretrained`` saves it.

Neither peft nor transformers is imported here: PEFT models are recognised by their interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from weftboard.proto.errors import InvalidArgument

__all__ = ["drop_aliases", "is_peft_model", "module_state", "served_module", "unwrap"]

# peft's own LoRA layer classes whose merge is ``weight += get_delta_weight(adapter)``.
_PEFT_LORA_MODULE = "peft.tuners.lora.layer"
_PEFT_MERGEABLE = {"Linear", "Embedding"}
_COMPILED = "_orig_mod"  # torch.compile's OptimizedModule keeps the model under this name


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside ``torch.compile``, ``DistributedDataParallel`` and ``DataParallel`` wrappers."""
    while True:
        if isinstance(getattr(model, _COMPILED, None), nn.Module):
            model = getattr(model, _COMPILED)
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` (unwrapped) is a PEFT ``PeftModel``: it has ``get_base_model`` and a ``peft_config``."""
    return callable(getattr(model, "get_base_model", None)) and isinstance(getattr(model, "peft_config", None), Mapping)


def served_module(model: nn.Module) -> nn.Module:
    """The module whose config and class name the served weights: unwrapped, a PEFT model's base model."""
    model = unwrap(model)
    return model.get_base_model() if is_peft_model(model) else model


def drop_aliases(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with each tensor once: a tensor under several names (the same storage, offset,
    shape, strides and dtype; a DTensor by its local shard) keeps its first name. Empty and meta
    tensors and non-tensors are kept as they are."""
    seen: set[tuple] = set()
    out: dict[str, Any] = {}
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if isinstance(local, torch.Tensor) and local.numel() and local.device.type != "meta":
            alias = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
                     local.stride(), local.dtype)
            if alias in seen:
                continue
            seen.add(alias)
        out[name] = value
    return out


def module_state(model: nn.Module) -> dict[str, Any]:
    """The served weights of ``model`` (see the module docstring): unwrapped, PEFT adapters
    merged, ``_orig_mod`` segments of compiled submodules removed, aliases dropped. The values
    are the model's own (detached) tensors, except merged ones, which are new tensors."""
    model = unwrap(model)
    state = _peft_state(model) if is_peft_model(model) else model.state_dict()
    segment = f".{_COMPILED}."
    renamed = {f".{name}".replace(segment, ".")[1:] if _COMPILED in name else name: value
               for name, value in state.items()}
    return drop_aliases(renamed)


# -- PEFT --------------------------------------------------------------------------------------


def _peft_state(peft_model: nn.Module) -> dict[str, Any]:
    """The base model's state dict with every adapter merged (names without ``base_model.model.``)."""
    configs: Mapping[str, Any] = peft_model.peft_config
    for adapter, config in configs.items():
        if getattr(config, "is_prompt_learning", False) or getattr(config, "is_adaption_prompt", False):
            raise InvalidArgument(f"cannot publish PEFT adapter {adapter!r}: a prompt-learning adapter "
                                  f"({type(config).__name__}) has no weights to merge into the model")
    base = peft_model.get_base_model()
    wrappers: dict[str, nn.Module] = {}  # prefix -> adapter layer or wrapper
    for name, module in base.named_modules():
        if any(name.startswith(p + ".") for p in wrappers):
            continue  # inside an adapter layer: its parts are read through it
        if _is_adapter_layer(module) or _is_aux_wrapper(module):
            wrappers[name] = module
    state = base.state_dict()
    out: dict[str, Any] = {}
    done: set[str] = set()
    with torch.no_grad():
        for key, value in state.items():
            prefix = _owner(key, wrappers)
            if prefix is None:
                out[key] = value
            elif prefix not in done:  # the merged tensors take the place of the wrapper's first ones
                done.add(prefix)
                out.update(_merged(prefix, wrappers[prefix]))
    return _tied_to_merged(out, state, wrappers)


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _tied_to_merged(out: dict[str, Any], state: Mapping[str, Any], wrappers: Mapping[str, nn.Module]) -> dict[str, Any]:
    """``out`` with every name tied to a merged weight (the same tensor as its base weight: an
    embedding tied to an adapted output head) holding that merged tensor, as ``merge_and_unload``
    leaves them (it merges in place, into the shared storage), so ``drop_aliases`` keeps one name.
    A tied tensor with an adapter under two of its names cannot be merged once: refused."""
    merged: dict[tuple, tuple[str, torch.Tensor]] = {}  # the base weight's alias key -> (name, merged)
    for key, value in out.items():
        prefix = _owner(key, wrappers)
        if prefix is None or not isinstance(value, torch.Tensor):
            continue
        rest = key[len(prefix) + 1:] if prefix else key
        original = state.get(f"{prefix}.base_layer.{rest}" if prefix else f"base_layer.{rest}")
        if isinstance(original, torch.Tensor) and original.numel():
            alias = _alias_key(original)
            if alias in merged and merged[alias][1] is not value:
                raise InvalidArgument(f"cannot publish the merged weights of {merged[alias][0]!r} and {key!r}: "
                                      "they are one tied tensor with an adapter under each name")
            merged[alias] = (key, value)
        copied = state.get(f"{prefix}.original_module.{rest}" if prefix else f"original_module.{rest}")
        if isinstance(copied, torch.Tensor) and copied.numel():  # a modules_to_save copy of a tied tensor
            tied = [k for k, v in out.items() if k != key and isinstance(v, torch.Tensor) and v.numel()
                    and _alias_key(v) == _alias_key(copied)]
            if tied:
                raise InvalidArgument(f"cannot publish PEFT module {prefix!r}: it trains a copy (modules_to_save) of "
                                      f"a tensor tied to {tied[0]!r}, so the served model would no longer be tied; "
                                      "untie them, or adapt the tensor with LoRA instead")
    if not merged:
        return out
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.numel() and (hit := merged.get(_alias_key(value))) is not None:
            out[key] = hit[1]
    return out


def _is_adapter_layer(module: nn.Module) -> bool:
    return isinstance(getattr(module, "base_layer", None), nn.Module)


def _is_aux_wrapper(module: nn.Module) -> bool:
    return (hasattr(module, "original_module")
            or any(c.__name__ == "AuxiliaryTrainingWrapper" for c in type(module).__mro__))


def _owner(key: str, wrappers: Mapping[str, nn.Module]) -> str | None:
    """The prefix of the adapter layer that ``key`` belongs to, if any."""
    if not wrappers:
        return None
    end = key.rfind(".")
    while end > 0:
        if key[:end] in wrappers:
            return key[:end]
        end = key.rfind(".", 0, end)
    return "" if "" in wrappers else None


def _merged(prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that replace adapter layer ``module`` at ``prefix``: its merged base layer's."""
    tensors = _merged_lora(prefix, module) if _is_adapter_layer(module) else _modules_to_save(prefix, module)
    return {f"{prefix}.{k}" if prefix else k: v for k, v in tensors.items()}


def _refuse(prefix: str, module: nn.Module, why: str) -> InvalidArgument:
    return InvalidArgument(f"cannot publish the merged weights of PEFT module {prefix!r} "
                           f"({type(module).__module__}.{type(module).__name__}): {why}; merge it yourself "
                           "(merge_and_unload() on a copy) and publish that state dict")


def _merged_lora(prefix: str, layer: nn.Module) -> dict[str, torch.Tensor]:
    cls = type(layer)
    if cls.__module__.startswith("peft.") and (cls.__module__ != _PEFT_LORA_MODULE or cls.__name__ not in _PEFT_MERGEABLE):
        raise _refuse(prefix, layer, f"weftboard merges LoRA {sorted(_PEFT_MERGEABLE)} layers only")
    if not callable(getattr(layer, "get_delta_weight", None)) or not hasattr(layer, "lora_A"):
        raise _refuse(prefix, layer, "not a LoRA layer")
    base = layer.base_layer
    if _is_adapter_layer(base):
        raise _refuse(prefix, layer, "stacked adapter layers")
    if getattr(layer, "merged", False):
        raise _refuse(prefix, layer, "its adapters are merged into the base layer (unmerge_adapter() first)")
    own = base.state_dict()
    weight = own.get("weight")
    if set(own) - {"weight", "bias"} or not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise _refuse(prefix, layer, f"its base layer holds {sorted(own)} (quantized or not a weight and bias)")
    if isinstance(weight, DTensor):
        raise _refuse(prefix, layer, "its base layer is sharded (DTensor)")
    if getattr(layer, "disable_adapters", False):
        return own
    present = set(getattr(layer, "lora_A", {})) | set(getattr(layer, "lora_embedding_A", None) or {})
    adapters = [a for a in getattr(layer, "active_adapters", ()) if a in present]
    for adapter in adapters:
        if adapter in (getattr(layer, "lora_variant", None) or {}) or (getattr(layer, "use_dora", None) or {}).get(adapter):
            raise _refuse(prefix, layer, f"adapter {adapter!r} is a LoRA variant (such as DoRA), not a plain delta")
        if (getattr(layer, "lora_bias", None) or {}).get(adapter):
            raise _refuse(prefix, layer, f"adapter {adapter!r} trains a LoRA bias")
    if adapters:
        # peft's merge (merge_and_unload, safe_merge=False), op for op, on a copy: each adapter's
        # delta added in place in the weight's dtype; Linear adds the delta as it is (an in-place
        # add computes in the wider dtype and rounds once), Embedding casts the delta first.
        embedding = getattr(layer, "lora_embedding_A", None) or {}
        merged = weight.clone()
        for adapter in adapters:
            delta = layer.get_delta_weight(adapter)
            if tuple(delta.shape) != tuple(weight.shape):
                raise _refuse(prefix, layer, f"adapter {adapter!r}'s delta is {tuple(delta.shape)}, the weight "
                                             f"{tuple(weight.shape)}")
            delta = delta.to(merged.device)
            merged += delta.to(merged.dtype) if adapter in embedding else delta
        own["weight"] = merged
    return own


def _modules_to_save(prefix: str, wrapper: nn.Module) -> dict[str, torch.Tensor]:
    """A ``modules_to_save`` wrapper serves its active adapter's copy (or, with none, the original)."""
    copies = getattr(wrapper, "modules_to_save", None)
    original = getattr(wrapper, "original_module", None)
    if not isinstance(copies, nn.ModuleDict) or not isinstance(original, nn.Module):
        raise _refuse(prefix, wrapper, "an adapter wrapper other than modules_to_save")
    active = [] if getattr(wrapper, "disable_adapters", False) else list(getattr(wrapper, "active_adapters", ()))
    chosen = copies[active[0]] if active and active[0] in copies else original
    return chosen.state_dict()
