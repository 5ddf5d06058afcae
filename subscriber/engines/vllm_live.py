"""The engine's live parameters written directly: a staged patch becomes a few writes between steps.

``LiveParams.bind`` places every checkpoint tensor in the model (``vllm_params``). A placed
parameter the engine computes from (every unquantized weight on GPUs; norms and embeddings on
CPUs) takes the elements that differ, written into its own storage. vLLM's CPU linear kernels
pack a weight into their own layout (a oneDNN handle, an AMX-packed tensor) held by the layer's
``cpu_linear``; for those (``KernelLayer``), ``stage`` packs the new weight with vLLM's own
dispatch while the engine serves, and ``write`` swaps the packed state in place: the handle
pointer in the tensor vLLM's traced graph reads, or the packed tensor's bytes. No Python object
the compiled model refers to is ever replaced, so CUDA graphs and vLLM's traced graphs stay valid.

Invariants:
- after ``write`` every placed slice holds exactly the checkpoint bytes it was staged from, and
  every packed kernel was packed from exactly those bytes (``mismatches`` checks both: bits
  for the parameters, probe outputs for the kernels);
- ``write`` refuses a staging made against parameters or kernels vLLM has replaced since
  (``stale``); a kernel whose packed state has a shape this module does not know is refused at
  ``bind`` (``Unplaceable``): the worker then uses vLLM's loader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weftboard.subscriber.engines.vllm_params import (
    Placement,
    Unplaceable,
    local_shape,
    place_checkpoint,
)

#: vLLM's CPU kernel preparation: a module holding ``weight`` (and ``bias``) -> its ``cpu_linear``
Packer = Callable[[torch.nn.Module], Callable[..., torch.Tensor]]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PROBE_ROWS = (1, 5, 32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


@dataclass
class _Changes:
    """The elements of one placement that differ: flat indices into the live slice and values."""

    live: torch.Tensor
    index: torch.Tensor
    values: torch.Tensor


@dataclass
class KernelLayer:
    """A CPU linear layer whose packed kernel holds its weight; ``feeds``: the placements of it."""

    path: str
    module: torch.nn.Module
    kernel: Callable[..., torch.Tensor]
    feeds: list[Placement]


@dataclass
class StagedWrite:
    changes: list[_Changes] = field(default_factory=list)
    kernels: list[tuple[KernelLayer, Callable[..., torch.Tensor]]] = field(default_factory=list)

    @property
    def elements(self) -> int:
        return sum(c.index.numel() for c in self.changes)


class LiveParams:
    """A model's placed parameters and packed kernels, and how to write them."""

    def __init__(self, model: torch.nn.Module, placements: list[Placement], kernels: list[KernelLayer],
                 pack: Packer | None) -> None:
        self.model = model
        self.placements = placements
        self.kernels = kernels
        self._pack = pack
        self._bound = {p.name: _param(model, p) for p in placements}
        self._by_name: dict[str, list[Placement]] = {}
        for p in placements:
            self._by_name.setdefault(p.name, []).append(p)

    @classmethod
    def bind(cls, model: torch.nn.Module, shadow: Mapping[str, torch.Tensor], pack: Packer | None) -> LiveParams:
        """Place ``shadow`` (the verified checkpoint tensors the model holds) in the model; ``pack``
        is vLLM's CPU kernel preparation (None off CPU). Refuses what it cannot write exactly."""
        placements = place_checkpoint(model, {n: tuple(t.shape) for n, t in shadow.items()})
        for p in placements:
            live = _param(model, p)
            if live.numel() and live.dtype != shadow[p.name].dtype:
                raise Unplaceable(f"{p.name}: the engine holds {p.module}.{p.param} as {live.dtype}, "
                                  f"the checkpoint as {shadow[p.name].dtype}")
        kernels = _kernel_layers(model, placements)
        if kernels and pack is None:
            raise Unplaceable(f"{kernels[0].path} has a packed CPU kernel and no packer was given")
        live = cls(model, placements, kernels, pack)
        for layer in kernels:
            fresh = live._packed(layer, shadow)
            _check_swappable(layer, fresh)
        return live

    def stale(self) -> list[str]:
        """What vLLM replaced since ``bind`` (a parameter or a kernel): names and layer paths."""
        gone = [p.name for p in self.placements if _param(self.model, p) is not self._bound[p.name]]
        return gone + [k.path for k in self.kernels if k.module.cpu_linear is not k.kernel]

    def stage(self, shadow: Mapping[str, torch.Tensor], names: Iterable[str]) -> StagedWrite:
        """What writing ``names``' verified bytes in ``shadow`` takes: the elements that differ in
        live parameters, and the kernels packed again from the new weights (the engine serves on)."""
        names = set(names)
        staged = StagedWrite()
        for name in sorted(names):
            for p in self._by_name.get(name, ()):
                if not self._bound[p.name].numel():
                    continue  # a weight only a packed kernel holds
                live = p.target_of(self._bound[p.name])
                new = _bits(p.source_of(shadow[name]).to(live.device)).reshape(-1)
                index = torch.nonzero(_bits(live).reshape(-1) != new).reshape(-1)
                if index.numel():
                    staged.changes.append(_Changes(live, index, new[index].clone()))
        for layer in self.kernels:
            if any(p.name in names for p in layer.feeds):
                staged.kernels.append((layer, self._packed(layer, shadow)))
        return staged

    def write(self, staged: StagedWrite) -> None:
        """Put a staging in place (between two engine steps)."""
        for c in staged.changes:
            bits = _bits(c.live)
            if c.live.is_contiguous():
                bits.view(-1).index_copy_(0, c.index, c.values)
            else:  # a strided slice (a row-parallel shard): write through its unravelled index
                bits[torch.unravel_index(c.index, c.live.shape)] = c.values
        for layer, fresh in staged.kernels:
            _swap_packed_state(layer.kernel, fresh)

    def mismatches(self, shadow: Mapping[str, torch.Tensor]) -> list[str]:
        """Names whose live slices are not bit for bit their bytes in ``shadow``, and layers whose
        kernel does not give the outputs of one packed from ``shadow``."""
        bad = []
        for p in self.placements:
            param = _param(self.model, p)
            if not param.numel():
                continue
            live = p.target_of(param)
            if not torch.equal(_bits(live), _bits(p.source_of(shadow[p.name]).to(live.device))):
                bad.append(p.name)
        for layer in self.kernels:
            weight = self._weight(layer, shadow)
            if not _same_outputs(layer.kernel, self._packed(layer, shadow), weight, getattr(layer.module, "bias", None)):
                bad.append(layer.path)
        return bad

    def _weight(self, layer: KernelLayer, shadow: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The layer's local weight as ``shadow`` has it (rows only vLLM holds, like vocabulary
        padding, come from the live weight)."""
        current = layer.module.weight
        if current.numel():
            weight = current.detach().clone()
        else:
            shape = local_shape(layer.module, "weight")
            assert shape is not None, layer.path
            weight = torch.empty(shape, dtype=shadow[layer.feeds[0].name].dtype)
        covered = 0
        for p in layer.feeds:
            target = p.target_of(weight)
            target.copy_(p.source_of(shadow[p.name]))
            covered += target.numel()
        if not current.numel() and covered != weight.numel():
            raise Unplaceable(f"{layer.path}: the checkpoint covers {covered} of its {weight.numel()} weights")
        return weight

    def _packed(self, layer: KernelLayer, shadow: Mapping[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
        """vLLM's kernel for the layer's weight as ``shadow`` has it, packed on a scratch module."""
        assert self._pack is not None
        scratch = torch.nn.Module()
        scratch.weight = torch.nn.Parameter(self._weight(layer, shadow), requires_grad=False)
        bias = getattr(layer.module, "bias", None)
        scratch.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        return self._pack(scratch)


def _param(model: torch.nn.Module, p: Placement) -> torch.Tensor:
    return getattr(model.get_submodule(p.module), p.param)


def _kernel_layers(model: torch.nn.Module, placements: list[Placement]) -> list[KernelLayer]:
    """CPU linear layers that compute from a packed copy of a placed weight."""
    weights = {(p.module, p.param): _param(model, p) for p in placements}
    layers = []
    for path, module in model.named_modules():
        kernel = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        if kernel is None or not isinstance(weight, torch.Tensor) or not _packed_state(kernel):
            continue  # no kernel, or one that reads the live weight it is given
        feeds = [p for p in placements if weights[(p.module, p.param)] is weight and p.param == "weight"]
        if feeds:
            layers.append(KernelLayer(path, module, kernel, feeds))
        elif path in {p.module for p in placements}:
            raise Unplaceable(f"{path}: its packed CPU kernel holds a weight the checkpoint does not place")
    return layers


def _packed_state(kernel: Callable[..., Any]) -> list[Any]:
    """What a vLLM CPU kernel closes over that holds weights: oneDNN handles and packed tensors."""
    cells = [c.cell_contents for c in (getattr(kernel, "__closure__", None) or ())]
    return [c for c in cells if isinstance(c, torch.Tensor) or hasattr(c, "handler_tensor")]


def _check_swappable(layer: KernelLayer, fresh: Callable[..., Any]) -> None:
    old, new = _packed_state(layer.kernel), _packed_state(fresh)
    if len(old) != len(new) or any(type(a) is not type(b) for a, b in zip(old, new, strict=True)):
        raise Unplaceable(f"{layer.path}: vLLM packs its kernel differently now ({type(layer.kernel).__name__})")
    for a, b in zip(old, new, strict=True):
        if isinstance(a, torch.Tensor) and (a.shape != b.shape or a.dtype != b.dtype):
            raise Unplaceable(f"{layer.path}: a packed tensor of {tuple(b.shape)} would replace {tuple(a.shape)}")
        if not isinstance(a, torch.Tensor) and (a.k, a.n) != (b.k, b.n):
            raise Unplaceable(f"{layer.path}: a oneDNN handle of {(b.k, b.n)} would replace {(a.k, a.n)}")


def _swap_packed_state(kernel: Callable[..., Any], fresh: Callable[..., Any]) -> None:
    """Give ``kernel`` the packed state of ``fresh`` without replacing any object it holds: a
    oneDNN handle pointer is exchanged (``fresh``'s handle then frees the old one when it goes);
    a packed tensor takes the new bytes."""
    for a, b in zip(_packed_state(kernel), _packed_state(fresh), strict=True):
        if isinstance(a, torch.Tensor):
            a.copy_(b)
        else:
            old = a.handler_tensor.clone()
            a.handler_tensor.copy_(b.handler_tensor)
            b.handler_tensor.copy_(old)


def _same_outputs(kernel: Callable[..., torch.Tensor], other: Callable[..., torch.Tensor], weight: torch.Tensor,
                  bias: torch.Tensor | None) -> bool:
    gen = torch.Generator().manual_seed(0)
    for rows in _PROBE_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
        if not torch.equal(kernel(x, weight, bias), other(x, weight, bias)):
            return False
    return True
