"""fp8 (e4m3fn, e5m2) with float32 scales, per tensor or per 128x128 block.

A scale here is always the *dequantization multiplier* (what serving engines store as
``weight_scale`` / DeepSeek-V3's ``weight_scale_inv``): ``value ~= fp8 * scale``.
Quantization is ``(x / scale).clamp(-max, max).to(fp8)`` in float32, i.e. torch's own
round-to-nearest-even cast after a saturating clamp (torch's cast alone saturates e4m3fn
but turns e5m2 overflow into Inf; the clamp makes both saturate, on every torch version).

Invariants:
- Fresh scales are ``max(amax / fp8_max, 2^-126)`` over the *finite* values of the tensor or
  block, so an all-zero block gets a defined, finite scale (2^-126) and quantizes to zeros.
- NaN elements stay NaN (fp8 has NaN codes); +-Inf saturates to +-max. Neither moves a scale.
- A scale "overflows" only when some value divided by it would round past the format's
  largest finite value (above 464 for e4m3fn, at or above 61440 for e5m2), not merely
  exceed it: a value that rounds down to the max loses nothing a fresh scale would keep.
- 128x128 blocks tile the matrix from the top left; edge blocks are partial and their scale
  covers only the elements that exist (the DeepSeek-V3 layout, shape ceil(rows/128) x
  ceil(cols/128)).
- Pure torch tensor ops, no host synchronisation: same bytes on CPU and CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weftboard.cuda.formats_fp4 import pow2_ceil

BLOCK = 128
SCALE_MIN = 2.0**-126
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# max + half an ulp at the top of the range, and whether a tie there rounds past max: RNE
# sends a tie to the even mantissa, which is 448 (1.110b) for e4m3fn but 65536 (Inf) for e5m2.
_OVERFLOW = {torch.float8_e4m3fn: (464.0, False), torch.float8_e5m2: (61440.0, True)}


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def fp8_overflows(scaled_magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where round-to-nearest-even of a scaled magnitude would leave the format's range."""
    bound, tie_overflows = _OVERFLOW[dtype]
    return scaled_magnitude >= bound if tie_overflows else scaled_magnitude > bound


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num_(x.abs(), nan=0.0, posinf=0.0)


def _padded_blocks(x: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> [R, 128, C, 128] zero-padded view of whole 128x128 tiles."""
    rows, cols = x.shape
    grid_rows, grid_cols = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = F.pad(x, (0, grid_cols * BLOCK - cols, 0, grid_rows * BLOCK - rows))
    return padded.view(grid_rows, BLOCK, grid_cols, BLOCK)


def block_grid(shape: tuple[int, ...]) -> tuple[int, int]:
    rows, cols = shape
    return -(-rows // BLOCK), -(-cols // BLOCK)


def amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """Finite max |x|: shape [1] per tensor, [R, C] per 128x128 block."""
    magnitude = _finite_abs(x)
    if granularity == "tensor":
        if magnitude.numel() == 0:
            return torch.zeros(1, dtype=torch.float32, device=x.device)
        return magnitude.amax().reshape(1)
    return _padded_blocks(magnitude).amax(dim=(1, 3))


def fp8_scales(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    policy: str,
    kept: torch.Tensor | None,
) -> torch.Tensor:
    """float32 dequant scales of float32 x under a policy (see weftboard.cuda.formats).

    "recompute": amax / max. "pow2": that, rounded up to a power of two. "fixed": the kept
    scale, except where a value would overflow it (or it is not a positive finite number),
    where the fresh scale replaces it, block by block.
    """
    current = amax(x, granularity)
    fresh = torch.clamp(current / fp8_max(dtype), min=SCALE_MIN)
    if policy == "pow2":
        return pow2_ceil(fresh)
    if policy != "fixed" or kept is None:
        return fresh
    kept = kept.to(device=x.device, dtype=torch.float32)
    usable = (kept > 0) & torch.isfinite(kept)
    overflow = fp8_overflows(current / kept, dtype)
    return torch.where(overflow | ~usable, fresh, kept)


def fp8_encode(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 values of float32 x [rows, cols] under per-tensor [1] or per-block [R, C] scales."""
    limit = fp8_max(dtype)
    if scale.dim() == 1:
        return (x / scale).clamp(-limit, limit).to(dtype).contiguous()  # (x may be a strided view)
    rows, cols = x.shape
    tiles = _padded_blocks(x) / scale[:, None, :, None]
    grid_rows, grid_cols = scale.shape
    scaled = tiles.reshape(grid_rows * BLOCK, grid_cols * BLOCK)[:rows, :cols]
    return scaled.clamp(-limit, limit).to(dtype).contiguous()


def fp8_quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str = "tensor",
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scales) of x; fresh scales unless given."""
    x = x.float()
    if scale is None:
        scale = fp8_scales(x, dtype, granularity, "recompute", None)
    return fp8_encode(x, scale, dtype), scale


def fp8_dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [rows, cols] = fp8 * scale (per tensor or per 128x128 block)."""
    x = values.float()
    if scale.dim() == 1:
        return x * scale
    rows, cols = x.shape
    tiles = _padded_blocks(x) * scale[:, None, :, None]
    grid_rows, grid_cols = scale.shape
    return tiles.reshape(grid_rows * BLOCK, grid_cols * BLOCK)[:rows, :cols].contiguous()
