"""MXFP4 decode (runtime side, torch only): E2M1 elements packed two per byte, one E8M0 scale per 32 along K.

Layout (K3_SPEC.md §3): byte = (code[2i+1] << 4) | code[2i] — low nibble is the even element. E2M1 code:
bit 3 sign, bits 0-2 index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Scale byte s means 2^(s-127); 0xFF is NaN.
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# code -> value for all 16 codes (8..15 are the negatives, 8 is -0.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# The Triton W4 decode multiplies by 2^(s-1) in bf16: exact for scale bytes up to this (|w| <= 12).
W4_MAX_SCALE_BYTE = 128
# MoE tactics whose decode is exact up to W4_MAX_SCALE_BYTE only (the build steps past them to triton_ds).
W4_TACTICS = ("triton_l", "triton_s", "triton_p", "triton_f8", "triton")
# The largest scale byte whose block stays finite in BF16 (and FP32) whatever its codes: 6 * 2^(252-127) = 1.5 * 2^127
# is below BF16's max (~1.99 * 2^127); at 253 (2^126) codes 4 and 6 decode to Inf, at 254 codes 2 and up.
E8M0_MAX_FINITE = 252
# The K tile of the strided-nibble layout (a scale group per nibble sub-block of 32).
STRIDE_BLOCK_K = 256


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 values as fp32, indexed by code."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Split each byte into its two 4-bit codes.

    Args:
        packed: uint8 [..., K/2]
    Returns:
        uint8 codes [..., K], element 2i from the low nibble, 2i+1 from the high nibble.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e2m1: expected uint8 packed codes, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w[..., k] = E2M1(code[..., k]) * 2^(scale[..., k // 32] - 127); scale byte 0xFF gives NaN.

    Args:
        packed: uint8 [..., K/2]
        scale: uint8 [..., K/32]
    Returns:
        [..., K] in `dtype` (computed in fp32; every MXFP4 value is exact in fp32 and bf16).
    """
    if scale.dtype != torch.uint8:
        raise TypeError(f"dequantize_mxfp4: expected uint8 E8M0 scales, got {scale.dtype}")
    k = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * MXFP4_BLOCK != k:
        raise ValueError(f"dequantize_mxfp4: scale shape {tuple(scale.shape)} does not match packed "
                         f"{tuple(packed.shape)} (expected [..., {k // MXFP4_BLOCK}])")
    values = e2m1_table(packed.device)[unpack_e2m1(packed).long()]  # [..., K]
    exps = scale.to(torch.int32) - E8M0_BIAS
    blocks = values.unflatten(-1, (k // MXFP4_BLOCK, MXFP4_BLOCK))
    out = torch.ldexp(blocks, exps.unsqueeze(-1).to(torch.float32))
    out = torch.where((scale == E8M0_NAN).unsqueeze(-1), torch.nan, out)
    return out.flatten(-2).to(dtype)


_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F
_HIGH_NIBBLES = -0x0F0F0F0F0F0F0F10  # 0xF0F0F0F0F0F0F0F0 as an int64


def _words(packed: torch.Tensor) -> torch.Tensor:
    """packed's bytes as int64 words (cloned first where its memory is not 8-byte aligned and contiguous)."""
    if packed.storage_offset() % 8 or not packed.is_contiguous():
        packed = packed.clone(memory_format=torch.contiguous_format)
    return packed.view(torch.int64)


def _merge_nibbles(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytewise over int64 words: (low nibble of x | low nibble of y << 4, high nibble of x | high nibble of y << 4)
    as uint8 bytes."""
    low = (x & _LOW_NIBBLES) | ((y << 4) & _HIGH_NIBBLES)
    high = ((x >> 4) & _LOW_NIBBLES) | (y & _HIGH_NIBBLES)
    return low.view(torch.uint8), high.view(torch.uint8)


def restride_mxfp4(packed: torch.Tensor, block_k: int = STRIDE_BLOCK_K) -> torch.Tensor:
    """MXFP4 bytes [..., R, K/2] (byte b = codes 2b | 2b+1 << 4) -> the strided-nibble layout of the "*_s"
    tactics: in each K tile of block_k, nibble q of 32-bit word j holds code q·(block_k/8) + j. Scales are
    unchanged.

    Done on 64-bit words, not nibble by nibble (the build runs it over every expert byte of a rank). With S =
    block_k/8, word j's byte p holds codes 2p·S + j and (2p+1)·S + j, which sit in the same nibble (low for
    even j, high for odd j) of tile bytes p·S + j//2 and p·S + S/2 + j//2.
    """
    K = packed.shape[-1] * 2
    if K % block_k or block_k % 256:
        raise ValueError(f"restride_mxfp4: K={K} must be a multiple of block_k={block_k}, itself a multiple of 256")
    sub = block_k // 8
    lead = packed.shape[:-1]
    words = _words(packed).reshape(*lead, K // block_k, 4, 2, sub // 16)              # tile bytes as [p, half, j//2]
    even, odd = _merge_nibbles(words[..., 0, :], words[..., 1, :])                     # [..., p, j//2], j even / odd
    out = torch.empty(*lead, K // block_k, sub // 2, 2, 4, dtype=torch.uint8, device=packed.device)  # [j//2, j%2, p]
    out[..., 0, :] = even.transpose(-1, -2)
    out[..., 1, :] = odd.transpose(-1, -2)
    return out.reshape(packed.shape)


# Where pair_mxfp4 puts each pair's bits inside a 32-bit word. Decoding pair i (codes 64i + 2j, 64i + 2j + 1 of
# the tile, for word j) to two bf16 bit patterns scaled by 2^-126 (the W4 decode's MAG 6 placement) is
#     shl(w, PAIR_MAG_SHIFT[i]) & 0x01C001C0  |  shl(w, PAIR_SIGN_SHIFT[i]) & 0x80008000
# with shl by a negative count a logical right shift. Plain shifts, not rotations: ptxas runs a left shift on the
# FMA pipe (IMAD.SHL) while a rotation (a funnel shift) can only take the ALU pipe, which bounds the decode (ncu,
# BENCHMARKS.md). A search over all shift placements: six masks a word, as with rotations, and one right shift
# (pairs 0 and 1 take one shift for both masks).
PAIR_MAG_SHIFT = (6, 3, 0, -7)
PAIR_SIGN_SHIFT = (6, 3, 5, 4)


def _pair_bit_luts() -> torch.Tensor:
    """[4, 256] int32: the bits of byte b of a nibble-paired word (nibble i: pair i's low code, nibble i + 4 its
    high code), moved to where the decode reads them; a word is the OR of its 4 bytes' entries."""
    dest = {}
    for i in range(4):
        for h in range(2):
            for t in range(4):
                shift, at = (PAIR_MAG_SHIFT[i], 6 + t) if t < 3 else (PAIR_SIGN_SHIFT[i], 15)
                dest[16 * h + 4 * i + t] = at + 16 * h - shift                  # the decode's output bit, shifted back
    assert sorted(dest.values()) == list(range(32))                                # a permutation of the bits
    luts = [[0] * 256 for _ in range(4)]
    for b in range(4):
        for v in range(256):
            word = sum(1 << dest[8 * b + bit] for bit in range(8) if v >> bit & 1)
            luts[b][v] = word - (1 << 32) if word >> 31 else word
    return torch.tensor(luts, dtype=torch.int32)


_PAIR_LUTS = _pair_bit_luts()


def pair_mxfp4(packed: torch.Tensor, block_k: int = STRIDE_BLOCK_K) -> torch.Tensor:
    """MXFP4 bytes [..., R, K/2] -> the paired layout of the "*_p" tactics: in each K tile of 256, 32-bit word j
    holds, as pair i < 4, codes 64i + 2j and 64i + 2j + 1, so that a decoded pair is two neighbours along K (what
    the MMA's operand registers hold); the pair's bits sit where PAIR_MAG_SHIFT / PAIR_SIGN_SHIFT read them. Scales
    are unchanged.

    Two steps. On 64-bit words, as restride_mxfp4: tile byte 32i + j holds codes 64i + 2j (low) and 64i + 2j + 1
    (high), so word j's bytes are the low nibbles of rows i = 0, 1 and of rows 2, 3, then their high nibbles.
    Then each word's bits are permuted, a byte at a time through _PAIR_LUTS.
    """
    K = packed.shape[-1] * 2
    if K % block_k or block_k != STRIDE_BLOCK_K:
        raise ValueError(f"pair_mxfp4: K={K} must be a multiple of block_k={STRIDE_BLOCK_K}")
    lead = packed.shape[:-1]
    rows = _words(packed).reshape(*lead, K // block_k, 4, 4)                           # tile bytes as [i, j // 8]
    out = torch.empty(*lead, K // block_k, 32, 4, dtype=torch.uint8, device=packed.device)  # [j, byte p of word j]
    for p, (a, b) in enumerate(((0, 1), (2, 3))):
        out[..., p], out[..., p + 2] = _merge_nibbles(rows[..., a, :], rows[..., b, :])
    luts = _PAIR_LUTS.to(packed.device)
    words = torch.take(luts[0], out[..., 0].long())  # take: 0.42 GB/s against indexing's 0.23 on the 2-core VM
    for p in range(1, 4):
        words |= torch.take(luts[p], out[..., p].long())
    return words.view(torch.uint8).reshape(packed.shape)


def _lane_order() -> torch.Tensor:
    """[256]: the K index (within a tile of STRIDE_BLOCK_K) that position m of lane_mxfp4's order holds. Position
    m = 64i + 16c + 8u + 2q + b (sub-block i, MMA column 16c + 8u + 2q + b, read by lane q of each quad) holds
    K = 32(2q + i//2) + 16(i%2) + 4c + 2u + b: lane q sees scale groups 2q and 2q + 1 only. A permutation of the
    index's bits (triton_kernels._lane_pos is its inverse)."""
    m = torch.arange(STRIDE_BLOCK_K)
    return (m & 1) | (((m >> 3) & 31) << 1) | (((m >> 1) & 3) << 6)


LANE_ORDER = _lane_order()


def lane_permute(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x with its `dim` (a multiple of STRIDE_BLOCK_K) in lane_mxfp4's K order: what the "triton_l" tactic reads as
    activations (the build permutes the rows of the GEMM that makes them)."""
    n = x.shape[dim]
    if n % STRIDE_BLOCK_K:
        raise ValueError(f"lane_permute: dim {dim} has {n} entries, not a multiple of {STRIDE_BLOCK_K}")
    index = (torch.arange(0, n, STRIDE_BLOCK_K)[:, None] + LANE_ORDER[None, :]).reshape(-1).to(x.device)
    return x.index_select(dim, index)


def lane_mxfp4(packed: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [..., R, K/2] -> the "*_l" tactics' layout: codes in LANE_ORDER along K, then pair_mxfp4's bits.
    Scales are unchanged (each group's 32 codes stay one group).

    LANE_ORDER keeps each byte's two codes together (bit 0 of the index is its own), so the codes move as whole
    bytes: byte 32a + 8i + c of a checkpoint tile of 128 bytes becomes byte 32i + 4c + a, a transpose of the tile as
    [4, 4, 8]. A permuted copy costs far less than a gather of the bytes or an unpack and repack of the nibbles:
    the build's pass over a rank's experts then takes about what pair_mxfp4 alone takes."""
    K = packed.shape[-1] * 2
    if K % STRIDE_BLOCK_K:
        raise ValueError(f"lane_mxfp4: K={K} must be a multiple of {STRIDE_BLOCK_K}")
    tiles = packed.unflatten(-1, (-1, 4, 4, 8))                                       # [..., tile, a, i, c]
    return pair_mxfp4(tiles.permute(*range(tiles.dim() - 3), -2, -1, -3).contiguous().flatten(-4))


TILE_ROWS = 64  # rows of a tile_rows tile (the Triton kernels' TILE_ROWS)


def tile_rows(t: torch.Tensor, tile_cols: int, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """[..., R, C] (expert bytes or scales, any row layout) -> the same shape with each tile of tile_rows rows ×
    tile_cols columns stored contiguously, the tiles of a row block one K tile after the other: a kernel program
    that walks K over a block of rows then reads one contiguous block a step, not tile_rows short runs."""
    R, C = t.shape[-2:]
    if R % tile_rows or C % tile_cols:
        raise ValueError(f"tile_rows: {list(t.shape)} must have rows a multiple of {tile_rows} and columns a multiple "
                         f"of {tile_cols}")
    lead = t.shape[:-2]
    return t.reshape(*lead, R // tile_rows, tile_rows, C // tile_cols, tile_cols).transpose(-3, -2).reshape(t.shape)


def tile_mxfp4(packed: torch.Tensor) -> torch.Tensor:
    """Expert bytes [..., R, K/2] (strided or paired) in row tiles of TILE_ROWS × one K tile of STRIDE_BLOCK_K."""
    return tile_rows(packed, STRIDE_BLOCK_K // 2)


def lane_tile_mxfp4(packed: torch.Tensor) -> torch.Tensor:
    """The "triton_l" tactic's bytes: lane_mxfp4's, in tile_mxfp4's row tiles."""
    return tile_mxfp4(lane_mxfp4(packed))


def tile_scales(scale: torch.Tensor) -> torch.Tensor:
    """Expert scales [..., R, K/32] in the same tiles as tile_mxfp4's bytes."""
    return tile_rows(scale, STRIDE_BLOCK_K // 32)


def pair_tile_mxfp4(packed: torch.Tensor) -> torch.Tensor:
    """The "triton_p" tactic's bytes: pair_mxfp4's, in tile_mxfp4's row tiles."""
    return tile_mxfp4(pair_mxfp4(packed))
