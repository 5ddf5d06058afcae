"""Block-scaled 4-bit formats: MXFP4 (OCP MX) and NVFP4, from float values to stored bytes.

Both formats store e2m1 codes (1 sign, 2 exponent, 1 mantissa bit: magnitudes 0, 0.5, 1,
1.5, 2, 3, 4, 6) packed two per byte, element ``2i`` in the low nibble and ``2i+1`` in the
high nibble, along the last dimension. They differ in their scales:

- MXFP4: one E8M0 byte per 32 consecutive elements of a row (a biased power-of-two
  exponent, bias 127, 255 = NaN). Scale rule: OCP's "floor" rule,
  ``2^(floor(log2(amax)) - 2)``, so a block's largest magnitude lands in [4, 8) and
  magnitudes in (6, 8) saturate to 6, as the OCP reference does.
- NVFP4: one float8_e4m3fn scale per 16 elements plus one float32 tensor scale.
  Tensor scale ``max(amax / (448 * 6), 1e-12)``; block scale ``(block_amax / 6) /
  tensor_scale`` clamped to [2^-6, 448] and cast to e4m3 (round to nearest even);
  values multiplied by ``(1 / tensor_scale) / block_scale``.

Invariants:
- Every result is a pure function of the inputs (and of the kept scales the caller passes):
  no randomness, no dependence on device or thread count. Values are encoded with round to
  nearest, ties to even, saturating at +-6; the sign of zero is kept (-0 encodes as 0x8).
- These rules reproduce torchao's reference quantizers bit for bit on finite input (checked
  against tests/data/quant_reference.safetensors). Two deliberate quirks follow from that:
  an E8M0 byte 0 is applied as 2^-126 when quantizing (the reference clamps to the smallest
  normal float32) but means 2^-127 when dequantizing (OCP); and NVFP4 block scales never go
  below 2^-6, the smallest normal e4m3.
- Non-finite input: scales are computed from finite values; +-Inf saturates to +-6. e2m1 has
  no NaN code, so a block holding a NaN gets a NaN scale (E8M0 255, e4m3 0x7F), which both
  formats define as "every value of this block is NaN"; its codes are 0.
- Only pure torch tensor ops, so the same code runs on CPU and CUDA tensors with identical
  bytes and without host synchronisation.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
# The smallest magnitude that round-to-nearest-even would carry past 6 (to 8, in a wider
# exponent range): a scaled value at or above it is a real overflow, not a rounding.
E2M1_OVERFLOW = 7.0
MX_BLOCK = 32
NV_BLOCK = 16
E4M3_MAX = 448.0
E4M3_OVERFLOW = 464.0  # RNE of anything at or above this would leave e4m3fn's range
NV_BLOCK_SCALE_MIN = 2.0**-6  # torch.finfo(torch.float8_e4m3fn).tiny, as the reference
NV_TENSOR_SCALE_MIN = 1e-12
NV_TENSOR_DIVISOR = E4M3_MAX * E2M1_MAX
# pow2 policy: the largest power of two e4m3 holds is 256, so the tensor scale is chosen for
# block scales up to 256 instead of 448.
NV_POW2_TENSOR_DIVISOR = 256.0 * E2M1_MAX
E8M0_NAN = 255

# Decision boundaries between consecutive e2m1 magnitudes and whether a tie at the boundary
# goes up (the upper neighbour has the even code) or stays down.
_E2M1_STEPS = (
    (0.25, False),  # 0 | 0.5   tie -> 0    (code 0)
    (0.75, True),  # 0.5 | 1   tie -> 1    (code 2)
    (1.25, False),  # 1 | 1.5   tie -> 1    (code 2)
    (1.75, True),  # 1.5 | 2   tie -> 2    (code 4)
    (2.5, False),  # 2 | 3     tie -> 2    (code 4)
    (3.5, True),  # 3 | 4     tie -> 4    (code 6)
    (5.0, False),  # 4 | 6     tie -> 4    (code 6)
)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---------------------------------------------------------------------------
# e2m1 codes and nibble packing
# ---------------------------------------------------------------------------


def e2m1_encode(scaled: torch.Tensor) -> torch.Tensor:
    """Encode already-scaled float32 values as e2m1 codes (uint8 0..15, one per element).

    Counting the boundaries a magnitude passes is round-to-nearest-even by construction and
    saturates: anything above 5 (including +Inf) is code 7 (6.0). NaN becomes code 0.
    """
    magnitude = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for bound, tie_goes_up in _E2M1_STEPS:
        code += (magnitude >= bound) if tie_goes_up else (magnitude > bound)
    negative = torch.signbit(scaled) & ~torch.isnan(scaled)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of each e2m1 code."""
    table = torch.tensor(
        E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device
    )
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes two per byte along the last dim: element 2i low nibble, 2i+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension ({codes.shape[-1]}) two per byte")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---------------------------------------------------------------------------
# helpers shared by both formats
# ---------------------------------------------------------------------------


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[rows, cols] float32 -> [rows, cols/block, block] view."""
    rows, cols = x.shape
    if cols % block:
        raise ValueError(f"last dimension {cols} is not a multiple of the block size {block}")
    return x.reshape(rows, cols // block, block)


def _block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block max |x| over finite values; NaN for a block that holds a NaN."""
    magnitude = torch.nan_to_num_(blocks.abs(), nan=float("nan"), posinf=0.0)
    return magnitude.amax(dim=-1)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite values of x, as a 0-d float32 tensor (0 when none)."""
    magnitude = torch.nan_to_num_(x.float().abs(), nan=0.0, posinf=0.0)
    if magnitude.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return magnitude.amax()


def pow2_ceil(value: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= value, for positive finite float32 values (NaN stays NaN)."""
    mantissa, exponent = torch.frexp(value)  # value = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    result = torch.ldexp(torch.ones_like(value), exponent)
    return torch.where(torch.isnan(value), value, result)


# ---------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------


def mxfp4_fresh_scales(x: torch.Tensor) -> torch.Tensor:
    """OCP "floor" E8M0 scales (uint8 [rows, cols/32]) for float32 x [rows, cols]."""
    amax = _block_amax(_blocks(x, MX_BLOCK))
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - 2  # floor(log2(amax)) - log2(4)
    biased = (exponent.clamp(-127, 128) + 127).to(torch.uint8)
    return torch.where(torch.isnan(amax), torch.full_like(biased, E8M0_NAN), biased)


def e8m0_to_float(scale: torch.Tensor, *, for_quantize: bool = False) -> torch.Tensor:
    """float32 value of E8M0 bytes: 2^(b - 127), NaN for 255.

    ``for_quantize`` applies byte 0 as 2^-126, the reference quantizer's convention.
    """
    bits = scale.to(torch.int32) << 23
    value = bits.view(torch.float32)
    floor = 2.0**-126 if for_quantize else 2.0**-127
    value = torch.where(scale == 0, torch.full_like(value, floor), value)
    return torch.where(scale == E8M0_NAN, torch.full_like(value, float("nan")), value)


def mxfp4_encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 data (uint8 [rows, cols/2]) of float32 x under E8M0 ``scale``."""
    blocks = _blocks(x, MX_BLOCK)
    divisor = e8m0_to_float(scale, for_quantize=True).unsqueeze(-1)
    codes = e2m1_encode(blocks / divisor).reshape(x.shape)
    return pack_nibbles(codes)


def mxfp4_scales(
    x: torch.Tensor, policy: str, kept: torch.Tensor | None
) -> torch.Tensor:
    """E8M0 scales under a scale policy (see weftboard.cuda.formats for the policies).

    E8M0 is a power of two already, so "pow2" is "recompute". "fixed" keeps each block's
    byte unless the block now needs a larger one (its values would clip beyond what the
    floor rule itself clips) or the kept byte is NaN.
    """
    fresh = mxfp4_fresh_scales(x)
    if policy != "fixed" or kept is None:
        return fresh
    kept = kept.to(device=fresh.device)
    move = (fresh > kept) | (kept == E8M0_NAN)
    return torch.where(move, fresh, kept)


def mxfp4_quantize(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed data, E8M0 scales) of x [rows, cols]; fresh floor-rule scales unless given."""
    x = x.float()
    if scale is None:
        scale = mxfp4_fresh_scales(x)
    return mxfp4_encode(x, scale), scale


def mxfp4_dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [rows, cols] from packed data and E8M0 scales (OCP semantics)."""
    values = e2m1_decode(unpack_nibbles(data))
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // MX_BLOCK, MX_BLOCK)
    return (blocks * e8m0_to_float(scale).unsqueeze(-1)).reshape(rows, cols)


# ---------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------


def nvfp4_fresh_tensor_scale(x: torch.Tensor, *, pow2: bool = False) -> torch.Tensor:
    """float32 [1] tensor scale: amax / (448 * 6), floored at 1e-12 (pow2: rounded up)."""
    amax = finite_amax(x)
    if pow2:
        scale = torch.clamp(amax / NV_POW2_TENSOR_DIVISOR, min=NV_TENSOR_SCALE_MIN)
        return pow2_ceil(scale).reshape(1)
    return torch.clamp(amax / NV_TENSOR_DIVISOR, min=NV_TENSOR_SCALE_MIN).reshape(1)


def _nvfp4_block_scale_values(
    amax: torch.Tensor, tensor_scale: torch.Tensor | None, *, pow2: bool
) -> torch.Tensor:
    """float32 block scales before the e4m3 cast (already on the e4m3 grid when pow2)."""
    scale = amax / E2M1_MAX
    if tensor_scale is not None:
        scale = scale / tensor_scale
    if pow2:
        return pow2_ceil(torch.clamp(scale, min=NV_BLOCK_SCALE_MIN, max=256.0))
    return torch.clamp(scale, min=NV_BLOCK_SCALE_MIN, max=E4M3_MAX)


def nvfp4_fresh_block_scales(
    x: torch.Tensor, tensor_scale: torch.Tensor | None, *, pow2: bool = False
) -> torch.Tensor:
    """float8_e4m3fn block scales [rows, cols/16]; one-level when tensor_scale is None."""
    amax = _block_amax(_blocks(x, NV_BLOCK))
    return _nvfp4_block_scale_values(amax, tensor_scale, pow2=pow2).to(torch.float8_e4m3fn)


def nvfp4_encode(
    x: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor | None
) -> torch.Tensor:
    """Packed e2m1 data of float32 x under the given scales."""
    blocks = _blocks(x, NV_BLOCK)
    block = block_scale.float()
    multiplier = 1.0 / block if tensor_scale is None else (1.0 / tensor_scale) / block
    codes = e2m1_encode(blocks * multiplier.unsqueeze(-1)).reshape(x.shape)
    return pack_nibbles(codes)


def nvfp4_scales(
    x: torch.Tensor,
    policy: str,
    kept: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block scales e4m3, tensor scale float32 [1]) under a scale policy.

    "fixed" keeps the tensor scale unless some block could not be represented even with the
    largest e4m3 block scale (then the whole tensor is recomputed, as at an anchor), and
    keeps each block scale unless one of its values would round past 6 (or it was NaN).
    Decisions are tensor ops, not Python branches, so CUDA never waits on the host.
    """
    pow2 = policy == "pow2"
    fresh_tensor = nvfp4_fresh_tensor_scale(x, pow2=pow2)
    if policy != "fixed" or kept is None:
        return nvfp4_fresh_block_scales(x, fresh_tensor, pow2=pow2), fresh_tensor
    kept_block, kept_tensor = (t.to(device=x.device) for t in kept)
    amax = _block_amax(_blocks(x, NV_BLOCK))
    finite_block_amax = torch.nan_to_num(amax, nan=0.0)
    tensor_overflow = ((finite_block_amax * (1.0 / kept_tensor)) / E4M3_MAX >= E2M1_OVERFLOW).any()
    tensor_overflow = tensor_overflow | ~(kept_tensor > 0).all() | ~torch.isfinite(kept_tensor).all()
    tensor_scale = torch.where(tensor_overflow, fresh_tensor, kept_tensor)
    fresh_block = _nvfp4_block_scale_values(amax, tensor_scale, pow2=False).to(torch.float8_e4m3fn)
    kept_float = kept_block.float()
    block_overflow = (amax * (1.0 / tensor_scale)) / kept_float >= E2M1_OVERFLOW
    move = block_overflow | torch.isnan(amax) | torch.isnan(kept_float) | tensor_overflow
    block_scale = torch.where(move, fresh_block.view(torch.uint8), kept_block.view(torch.uint8))
    return block_scale.view(torch.float8_e4m3fn), tensor_scale


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    two_level: bool = True,
    block_scale: torch.Tensor | None = None,
    tensor_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(packed data, e4m3 block scales, tensor scale or None) of x; fresh scales unless given."""
    x = x.float()
    if two_level and tensor_scale is None:
        tensor_scale = nvfp4_fresh_tensor_scale(x)
    if not two_level:
        tensor_scale = None
    if block_scale is None:
        block_scale = nvfp4_fresh_block_scales(x, tensor_scale)
    return nvfp4_encode(x, block_scale, tensor_scale), block_scale, tensor_scale


def nvfp4_dequantize(
    data: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor | None
) -> torch.Tensor:
    """float32 [rows, cols]: code * block_scale (* tensor_scale)."""
    values = e2m1_decode(unpack_nibbles(data))
    rows, cols = values.shape
    scale = block_scale.float()
    if tensor_scale is not None:
        scale = scale * tensor_scale.float()
    blocks = values.reshape(rows, cols // NV_BLOCK, NV_BLOCK)
    return (blocks * scale.unsqueeze(-1)).reshape(rows, cols)
