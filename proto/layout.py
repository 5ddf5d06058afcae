"""A run's layout: the tensors it serves (names, dtypes, shapes, in order) and its served format.

A run fixes its layout at creation; every version record names exactly these tensors in
this order. ``check_layout`` states what a well-formed layout is; its messages name the
request field (``run.layout...``) so a caller can fix it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from weftboard.proto.errors import InvalidArgument

_DTYPE = re.compile(r"[a-z][a-z0-9_]*")  # fullmatch: no trailing newline


@dataclass(frozen=True)
class TensorSpec:
    name: str  # safetensors key
    dtype: str  # torch dtype name without "torch.": "bfloat16", "float8_e4m3fn", ...
    shape: tuple[int, ...]  # stored shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ServedFormat:
    """How islands serve the weights: ``kind`` is "bf16", "fp8_e4m3", ... ("" when unset)."""

    kind: str = ""
    scale_granularity: str = ""
    scale_policy: str = ""
    keep_bf16_patterns: tuple[str, ...] = ()


@dataclass(frozen=True)
class Layout:
    tensors: tuple[TensorSpec, ...]
    served_format: ServedFormat = ServedFormat()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)


def check_layout(layout: Layout) -> None:
    """A layout a run may fix: a served format, and named, unique tensors with valid dtypes and shapes."""
    fmt = layout.served_format
    if not fmt.kind:
        raise InvalidArgument("run.served_format.kind must be set (e.g. FORMAT_KIND_BF16)")
    for field_name, value in (("kind", fmt.kind), ("scale_granularity", fmt.scale_granularity),
                              ("scale_policy", fmt.scale_policy)):
        if value.startswith("unknown("):  # a number this board's protocol does not name
            raise InvalidArgument(f"run.served_format.{field_name} {value} is not a value this board knows")
    if not layout.tensors:
        raise InvalidArgument("run.layout.tensors is empty; a run fixes its tensor layout")
    seen: set[str] = set()
    for i, spec in enumerate(layout.tensors):
        if not spec.name:
            raise InvalidArgument(f"run.layout.tensors[{i}].name is empty")
        if spec.name in seen:
            raise InvalidArgument(f"run.layout.tensors[{i}].name {spec.name!r} appears twice")
        seen.add(spec.name)
        if not _DTYPE.fullmatch(spec.dtype):
            raise InvalidArgument(
                f"run.layout.tensors[{i}].dtype {spec.dtype!r} is not a torch dtype name (e.g. 'bfloat16')"
            )
        if any(d < 0 for d in spec.shape):
            raise InvalidArgument(f"run.layout.tensors[{i}].shape {list(spec.shape)} has a negative dimension")
