"""Where each checkpoint tensor lives inside a vLLM model: the placements of direct writes.

``place_checkpoint(model, shapes)`` answers, for every checkpoint tensor a worker holds, the
parameter it lands in and the slice on both sides (``Placement``): the rows of ``q/k/v_proj``
inside ``qkv_proj`` and of ``gate/up_proj`` inside ``gate_up_proj``, the tensor-parallel shard
this worker holds (column-parallel rows, row-parallel columns, vocabulary rows), and nothing for
an output head tied to the input embedding (it is the same parameter). It reads only the
attributes vLLM's layers keep (``tp_rank``, ``num_heads``, ``output_sizes``...) and the
model's ``packed_modules_mapping``; the module imports no vLLM.

Invariants:
- a placement's source slice (of the checkpoint tensor) and destination slice (of the
  parameter) have the same shape, and a parameter's placements never overlap;
- a name that cannot be placed exactly raises ``Unplaceable`` with the reason: the worker then
  writes every version through vLLM's own loader instead (never a guess).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weftboard.proto.errors import WeftboardError


class Unplaceable(WeftboardError):
    """A checkpoint tensor whose place in the model is not known exactly."""


@dataclass(frozen=True)
class Cut:
    """``length`` indices from ``start`` along ``dim`` (``None`` in a placement: the whole tensor)."""

    dim: int
    start: int
    length: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length)


@dataclass(frozen=True)
class Placement:
    """Checkpoint tensor ``name`` (``source`` of it) is ``target`` of ``module.param``."""

    name: str
    module: str
    param: str
    source: Cut | None
    target: Cut | None

    def source_of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.source is None else self.source.of(tensor)

    def target_of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.target is None else self.target.of(tensor)


_TIED_HEAD = "lm_head"


def place_checkpoint(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> list[Placement]:
    """The placements of every checkpoint name in ``shapes`` (name -> full checkpoint shape)."""
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
    fused_of = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
    placements: list[Placement] = []
    for name, shape in shapes.items():
        module_path, _, param = name.rpartition(".")
        head, _, last = module_path.rpartition(".")
        shard: int | None = None
        if last in fused_of:
            fused, shard = fused_of[last]
            module_path = f"{head}.{fused}" if head else fused
        module = _submodule(model, module_path, name)
        if module_path.split(".")[-1] == _TIED_HEAD and _tied_to_embedding(model, module):
            continue  # the embedding's placement writes it
        live = getattr(module, param, None)
        if not isinstance(live, torch.Tensor):
            raise Unplaceable(f"{name}: {module_path} has no tensor {param!r}")
        placements.append(_place(name, module_path, param, module, tuple(shape), shard, live))
    _check_disjoint(placements)
    return placements


def local_shape(module: torch.nn.Module, param: str) -> tuple[int, ...] | None:
    """The shape of ``module.param`` on this worker as vLLM created it (a CPU linear layer's
    weight is emptied once its kernel packed it); ``None`` when the module does not say."""
    if param == "weight" and hasattr(module, "output_size_per_partition") and hasattr(module, "input_size_per_partition"):
        return (int(module.output_size_per_partition), int(module.input_size_per_partition))
    return None


def _place(name: str, module_path: str, param: str, module: torch.nn.Module, shape: tuple[int, ...],
           shard: int | None, live: torch.Tensor) -> Placement:
    kinds = {cls.__name__ for cls in type(module).__mro__}
    tp_rank = int(getattr(module, "tp_rank", 0))
    if "QKVParallelLinear" in kinds:
        source, target = _qkv_cuts(module, shard, tp_rank, name)
    elif "MergedColumnParallelLinear" in kinds:
        if shard is None:
            raise Unplaceable(f"{name}: {module_path} is fused but the name is none of its parts")
        sizes = [int(s) // int(module.tp_size) for s in module.output_sizes]
        source, target = Cut(0, tp_rank * sizes[shard], sizes[shard]), Cut(0, sum(sizes[:shard]), sizes[shard])
    elif "RowParallelLinear" in kinds:
        width = int(module.input_size_per_partition)
        source = Cut(1, tp_rank * width, width) if param == "weight" and len(shape) == 2 else None
        target = None
    elif "ColumnParallelLinear" in kinds:
        rows = int(module.output_size_per_partition)
        source, target = Cut(0, tp_rank * rows, rows), None
    elif "VocabParallelEmbedding" in kinds:
        idx = module.shard_indices
        rows = int(idx.org_vocab_end_index) - int(idx.org_vocab_start_index)
        source, target = Cut(0, int(idx.org_vocab_start_index), rows), Cut(0, 0, rows)
    else:
        source = target = None
    placement = Placement(name, module_path, param, source, target)
    want = local_shape(module, param) if live.numel() == 0 else tuple(live.shape)
    if want is None:
        raise Unplaceable(f"{name}: {module_path}.{param} is empty and its layer does not say its shape")
    got = tuple(placement.source_of(torch.empty(shape, device="meta")).shape)
    into = tuple(placement.target_of(torch.empty(want, device="meta")).shape)
    if got != into:
        raise Unplaceable(f"{name}: {got} from the checkpoint does not fit {into} of {module_path}.{param} "
                          f"({'/'.join(sorted(kinds & _KNOWN)) or type(module).__name__})")
    return placement


_KNOWN = {"QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear", "ColumnParallelLinear",
          "VocabParallelEmbedding"}


def _qkv_cuts(module: torch.nn.Module, shard: int | None, tp_rank: int, name: str) -> tuple[Cut, Cut]:
    if shard is None or shard > 2:
        raise Unplaceable(f"{name}: a qkv_proj part must be q, k or v")
    q = int(module.num_heads) * int(module.head_size)
    k = int(module.num_kv_heads) * int(module.head_size)
    v = int(module.num_kv_heads) * int(getattr(module, "v_head_size", module.head_size))
    kv_rank = tp_rank // int(getattr(module, "num_kv_head_replicas", 1))
    return [(Cut(0, tp_rank * q, q), Cut(0, 0, q)),
            (Cut(0, kv_rank * k, k), Cut(0, q, k)),
            (Cut(0, kv_rank * v, v), Cut(0, q + k, v))][shard]


def _submodule(model: torch.nn.Module, path: str, name: str) -> torch.nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise Unplaceable(f"{name}: the model has no module {path!r} (a renamed architecture)") from None


def _tied_to_embedding(model: torch.nn.Module, head: torch.nn.Module) -> bool:
    weight = getattr(head, "weight", None)
    return any(weight is getattr(m, "weight", None) for n, m in model.named_modules() if n.endswith("embed_tokens"))


def _check_disjoint(placements: list[Placement]) -> None:
    seen: dict[tuple[str, str], list[Placement]] = {}
    for p in placements:
        for other in seen.setdefault((p.module, p.param), []):
            a, b = p.target, other.target
            if a is None or b is None or a.dim != b.dim or (a.start < b.start + b.length and b.start < a.start + a.length):
                raise Unplaceable(f"{p.name} and {other.name} both write {p.module}.{p.param}")
        seen[(p.module, p.param)].append(p)
