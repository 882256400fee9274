"""MXFP4 codec, builder side: pack and quantize (OCP MX v1.0), plus validation of checkpoint scales.

Decoding lives in `k3plugins.moe.mxfp4` (the runtime needs it too) and is re-exported here.
Quantization of a block of 32 along K (OCP MX v1.0 §6.3): shared exponent X = floor(log2(amax)) - 2
(2 = emax of E2M1), clamped to E8M0's range [-127, 127]; each element w / 2^X is rounded to nearest, ties to
even, onto the E2M1 grid, saturating at ±6. An all-zero block gets X = -127 (scale byte 0), which stays finite.
"""

from __future__ import annotations

import torch

from k3plugins.moe.mxfp4 import (E2M1_VALUES, E8M0_BIAS, E8M0_MAX_FINITE, E8M0_NAN, MXFP4_BLOCK, dequantize_mxfp4,
                                 e2m1_table, unpack_e2m1)

__all__ = ["E2M1_VALUES", "MXFP4_BLOCK", "dequantize_mxfp4", "e2m1_table", "unpack_e2m1", "pack_e2m1",
           "quantize_mxfp4", "check_scale", "MXFP4Error"]

E2M1_EMAX = 2
E2M1_MAX = 6.0
PLAUSIBLE_EXPONENT = 64  # |median block-scale exponent| a checkpoint's scales may have (check_scale)


class MXFP4Error(ValueError):
    """MXFP4 data that cannot be valid (NaN scale, wrong shape); the message names the tensor."""


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte, element 2i in the low nibble.

    Args:
        codes: uint8 [..., K] with values 0..15, K even
    Returns:
        uint8 [..., K/2]
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_e2m1: expected uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim must be even, got {codes.shape[-1]}")
    pairs = codes.unflatten(-1, (codes.shape[-1] // 2, 2))
    return (pairs[..., 0] & 0x0F) | (pairs[..., 1] << 4)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by the block scale) -> E2M1 codes, RNE with saturation to ±6."""
    bits = x.view(torch.int32)
    sign = (bits >> 28) & 8  # arithmetic shift: 8 for negative (incl. -0.0), 0 otherwise
    mag = bits & 0x7FFFFFFF
    # Normal E2M1 (|x| >= 1) keeps 1 mantissa bit: round the fp32 bits at bit 22, ties to even, and the
    # exponent/mantissa pair then reads directly as the code (fp32 exponent 127 -> code 2).
    normal = ((mag + 0x1FFFFF + ((mag >> 22) & 1)) >> 22) - 252
    # Below 1 the grid is multiples of 0.5 (codes 0, 1, 2); torch.round is half-to-even.
    sub = torch.round(mag.view(torch.float32) * 2).to(torch.int32)
    code = torch.where(mag < (127 << 23), sub, normal).clamp_(max=7)
    return (code | sign).to(torch.uint8)


def _block_amax_bits(blocks: torch.Tensor) -> torch.Tensor:
    """|w| bit patterns reduced to the max per block (int order = float order for non-negative floats)."""
    m = blocks.view(torch.int32) & 0x7FFFFFFF  # [..., K/32, 32]
    while m.shape[-1] > 1:  # halving tree: much faster on CPU than a reduction over a 32-wide last dim
        h = m.shape[-1] // 2
        m = torch.maximum(m[..., :h], m[..., h:])
    return m[..., 0]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float weights to MXFP4 along the last dim.

    Args:
        w: float [..., K], K a multiple of 32, all finite
    Returns:
        (packed uint8 [..., K/2], scale uint8 [..., K/32])
    """
    if not w.is_floating_point():
        raise TypeError(f"quantize_mxfp4: expected a float tensor, got {w.dtype}")
    k = w.shape[-1]
    if k % MXFP4_BLOCK:
        raise ValueError(f"quantize_mxfp4: last dim {k} is not a multiple of {MXFP4_BLOCK}")
    blocks = w.to(torch.float32).contiguous().unflatten(-1, (k // MXFP4_BLOCK, MXFP4_BLOCK))  # [..., K/32, 32]
    amax = _block_amax_bits(blocks)  # [..., K/32]
    if bool((amax >= 0x7F800000).any()):
        raise ValueError("quantize_mxfp4: input holds NaN or Inf")
    # The fp32 exponent field of amax is floor(log2(amax)) + 127 (0 for zero/subnormal: clamped to -127 anyway).
    shared = ((amax >> 23) - (E8M0_BIAS + E2M1_EMAX)).clamp_(-E8M0_BIAS, E8M0_BIAS)
    scaled = torch.ldexp(blocks, (-shared).unsqueeze(-1).to(torch.float32))
    codes = _e2m1_codes(scaled).flatten(-2)
    return pack_e2m1(codes), (shared + E8M0_BIAS).to(torch.uint8)


def check_scale(scale: torch.Tensor, name: str) -> None:
    """Refuse E8M0 scale bytes of 0xFF (NaN) and those above E8M0_MAX_FINITE (decoded weights overflow to Inf), and
    scales whose median is implausible for weights (PLAUSIBLE_EXPONENT); `name` goes into the message."""
    if scale.dtype != torch.uint8:
        raise MXFP4Error(f"{name}: expected uint8 E8M0 scales, got {scale.dtype}")
    bad = scale > E8M0_MAX_FINITE
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        byte = int(scale[idx])
        what = "NaN in E8M0" if byte == E8M0_NAN else f"2^{byte - E8M0_BIAS}: its weights decode to Inf in BF16"
        raise MXFP4Error(f"{name}: scale byte 0x{byte:02X} ({what}) at index {list(idx)}; "
                         f"expected bytes 0..{E8M0_MAX_FINITE} ({int(bad.sum())} bad bytes)")
    # bytes that all decode finite can still be the wrong encoding: exponents stored unbiased (two's complement, a
    # weight of 2^-7 as 0xF9) read as E8M0 scale every weight by 2^122 or so. Real weights' block scales lie far
    # inside 2^±64, so a median outside it (over the non-zero bytes: an all-zero block's byte is 0) is refused.
    used = scale[scale != 0]
    if used.numel():
        median = int(used.flatten().kthvalue((used.numel() + 1) // 2).values) - E8M0_BIAS
        if abs(median) > PLAUSIBLE_EXPONENT:
            raise MXFP4Error(f"{name}: the median block scale is 2^{median}; expected E8M0 bytes (exponent + "
                             f"{E8M0_BIAS}) of weights within 2^±{PLAUSIBLE_EXPONENT}: are the exponents stored "
                             f"unbiased (signed)?")


def check_packed_pair(packed_shape: tuple[int, ...], scale_shape: tuple[int, ...], name: str) -> None:
    """Shapes of a packed tensor and its scales must describe the same [..., K]."""
    k = packed_shape[-1] * 2
    if tuple(scale_shape[:-1]) != tuple(packed_shape[:-1]) or scale_shape[-1] * MXFP4_BLOCK != k:
        raise MXFP4Error(f"{name}: weight_scale shape {list(scale_shape)} does not match weight_packed "
                         f"{list(packed_shape)}; expected {list(packed_shape[:-1]) + [k // MXFP4_BLOCK]}")
