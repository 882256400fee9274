"""Triton kernels of the MXFP4 grouped MoE (W4A16); the host side is in triton.py.

Weights stay in the build's layout (K3_SPEC.md §3): w13 [E, 2I, Dl/2] u8 (gate rows then up rows),
w2 [E, Dl, I/2] u8, scales [E, rows, K/32] u8 E8M0. Each program owns (expert, BN weight rows) and walks
that expert's tokens BM at a time, so the weights are the MMA's M side (swap-AB: decode has 1-8 tokens
per expert, far below a tensor-core tile) and are read from HBM once per expert.

Two ways to turn MXFP4 into MMA operands (constexpr W4):
  W4=True  — our bit-level decode: the weights are read as int32 words of 8 codes and each pair of codes
             becomes one bf16x2 register with a shift and a mask (E2M1 bits placed in the bf16 exponent and
             mantissa, then one packed multiply by 2^(s-1)). About 4 instructions per weight against ~19 for
             a float decode, which decided decode speed: at 1-8 tokens per expert the kernel was bound by
             instruction issue, not by the MMA (the paired layout's 3 a weight left it latency-bound instead).
             The pairs come out with bits 0 and 1 of the K index swapped (within every 8), so the activations
             are read in that order too (`swap01`).
  W4=False — Triton's tl.dot_scaled (native MX MMA where the hardware has it, upcast elsewhere).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from k3plugins.mlp.triton import glu_act
from k3plugins.moe import mxfp4
from k3plugins.pdl import pdl_prologue


@triton.jit
def swap01(k):
    """K order of a W4 tile: bits 0 and 1 of the index swapped (an involution, so also its inverse)."""
    return (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1)


@triton.jit
def _code_pair(w, SHIFT: tl.constexpr, MAG: tl.constexpr = 6):
    """Codes at bits [SHIFT, SHIFT+4) and [SHIFT+16, SHIFT+20) of uint32 w -> two E2M1 values as 16-bit float bit
    patterns: the magnitude bits land at MAG..MAG+2 (the exponent's low bits and the mantissa's top bit), the sign
    in bit 15. MAG 6: bf16 values scaled by 2^-126; MAG 9: fp16 values scaled by 2^-14."""
    MASK: tl.constexpr = 0x70007 << MAG
    if SHIFT <= MAG:
        mag = (w << (MAG - SHIFT)) & MASK
    else:
        mag = (w >> (SHIFT - MAG)) & MASK
    if SHIFT <= 12:
        sign = (w << (12 - SHIFT)) & 0x80008000
    else:
        sign = (w >> (SHIFT - 12)) & 0x80008000
    return mag | sign


@triton.jit
def _halves(p, BF16: tl.constexpr):
    """uint32 holding two bf16 bit patterns -> (low, high) as bf16, or as fp32 (exact; for fp32/fp16
    activations and for the interpreter, which has no bf16)."""
    if BF16:
        lo = (p & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        lo = (p << 16).to(tl.float32, bitcast=True)
        hi = (p & 0xFFFF0000).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _scale(s, BF16: tl.constexpr):
    """E8M0 bytes -> 2^(s-1), which undoes the decode's 2^-126, built from bits (exact; exp2 may not be): bf16, or
    fp32 for the fp32 path."""
    if BF16:
        sc = ((s.to(tl.uint16) + 126) << 7).to(tl.bfloat16, bitcast=True)
    else:
        sc = ((s.to(tl.uint32) + 126) << 23).to(tl.float32, bitcast=True)
    return sc


@triton.jit
def _dequant_w4(w, s, BN: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr):
    """w int32 [BN, BK/8] (8 codes each, byte b = codes 2b | 2b+1 << 4), s u8 [BN, BK/32] E8M0
    -> [BN, BK] DTYPE in swap01 K order. Exact for scale bytes <= 128 (2^(s-1) must be finite in bf16)."""
    BF16: tl.constexpr = DTYPE == tl.bfloat16
    w = w.to(tl.uint32, bitcast=True)
    # pair i holds codes (k, k+4) of the word's 8: i=0 -> (0, 4), 1 -> (1, 5), 2 -> (2, 6), 3 -> (3, 7)
    a0, b0 = _halves(_code_pair(w, 0), BF16)
    a1, b1 = _halves(_code_pair(w, 4), BF16)
    a2, b2 = _halves(_code_pair(w, 8), BF16)
    a3, b3 = _halves(_code_pair(w, 12), BF16)
    # joined order within 8: 0 2 1 3 4 6 5 7 = swap01
    x = tl.join(tl.join(tl.join(a0, b0), tl.join(a1, b1)), tl.join(tl.join(a2, b2), tl.join(a3, b3)))
    x = tl.reshape(x, (BN, BK // 32, 32))
    return tl.reshape(x * _scale(s, BF16)[:, :, None], (BN, BK)).to(DTYPE)


@triton.jit
def _mx_dot(acc, w, s, xT, BN: tl.constexpr, BK: tl.constexpr, W4: tl.constexpr):
    """acc [BN, BM] += W[BN, BK] @ xT[BK, BM]; W as int32 words (W4) or u8 codes, with scales [BN, BK/32]."""
    if W4:
        acc = tl.dot(_dequant_w4(w, s, BN, BK, xT.dtype), xT, acc)
    else:
        acc = tl.dot_scaled(w, s, "e2m1", xT, None, "bf16" if xT.dtype == tl.bfloat16 else "fp16", acc)
    return acc


@triton.jit
def _strided_dot(acc, w, s, xT_ptrs, x_mask, k0, BN: tl.constexpr, SUB: tl.constexpr, DTYPE: tl.constexpr,
                 F16: tl.constexpr = False):
    """acc [BN, BM] += W[BN, 8·SUB] @ X[8·SUB, BM] for weights in the strided-nibble layout (`restride_mxfp4`):
    nibble q of word j holds k = q·SUB + j, so nibbles (i, i+4) of the [BN, SUB] words decode to two contiguous
    K sub-blocks, each fed to its own dot. No join/reshape of the decoded values: they need no shared-memory
    round trip to reach the MMA operand layout. SUB == 32, so sub-block q has one scale, column q of s [BN, 8]
    (loaded with the weights, so it is pipelined too). F16 (the FP8 tactic): decode to fp16, s is the [BN, 8] fp16
    multiplier of each sub-block, and the products are cast to DTYPE (e4m3)."""
    BF16: tl.constexpr = DTYPE == tl.bfloat16
    w = w.to(tl.uint32, bitcast=True)
    # columns of s by the bits of q = 4a + 2b + c: split c, then b, then a (lo: a = 0, hi: a = 1)
    s_c0, s_c1 = tl.split(tl.reshape(s, (BN, 2, 2, 2)))
    s_c0b0, s_c0b1 = tl.split(s_c0)
    s_c1b0, s_c1b1 = tl.split(s_c1)
    for i in tl.static_range(4):
        if F16:
            p = _code_pair(w, 4 * i, 9)
            lo = (p & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (p >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        else:
            lo, hi = _halves(_code_pair(w, 4 * i), BF16)
        if i == 0:
            s_lo, s_hi = tl.split(s_c0b0)
        elif i == 1:
            s_lo, s_hi = tl.split(s_c1b0)
        elif i == 2:
            s_lo, s_hi = tl.split(s_c0b1)
        else:
            s_lo, s_hi = tl.split(s_c1b1)
        x_lo = tl.load(xT_ptrs + (k0 + i * SUB), mask=x_mask, other=0.0)
        x_hi = tl.load(xT_ptrs + (k0 + (i + 4) * SUB), mask=x_mask, other=0.0)
        if not F16:
            s_lo = _scale(s_lo, BF16)
            s_hi = _scale(s_hi, BF16)
        acc = tl.dot((lo * s_lo[:, None]).to(DTYPE), x_lo, acc)
        acc = tl.dot((hi * s_hi[:, None]).to(DTYPE), x_hi, acc)
    return acc


@triton.jit
def _paired_codes(w, I: tl.constexpr):
    """Pair I of each word in pair_mxfp4's layout as two bf16 bit patterns (values × 2^-126, as _code_pair's MAG
    6): the shifts of mxfp4.PAIR_MAG_SHIFT / PAIR_SIGN_SHIFT (pairs 0 and 1: one shift for both masks). ptxas
    makes the left shifts IMAD.SHL (FMA pipe), so the ALU pipe keeps six masks and one shift a word."""
    MAG: tl.constexpr = 0x01C001C0
    SIGN: tl.constexpr = 0x80008000
    if I == 0:
        p = (w << 6) & (MAG | SIGN)
    elif I == 1:
        p = (w << 3) & (MAG | SIGN)
    elif I == 2:
        p = (w & MAG) | ((w << 5) & SIGN)
    else:
        p = ((w >> 7) & MAG) | ((w << 4) & SIGN)
    return p


@triton.jit
def _lane_pos(n):
    """Where K index n sits in lane_mxfp4's order (mxfp4.LANE_ORDER's inverse, bits of n within its tile of 256)."""
    return (n & ~255) | (n & 1) | (((n >> 1) & 31) << 3) | (((n >> 6) & 3) << 1)


@triton.jit
def _paired_dot(acc, w, s, xT_ptrs, x_mask, k0, BN: tl.constexpr, DTYPE: tl.constexpr, L2_ONLY: tl.constexpr = False,
                LANE: tl.constexpr = False, ASM: tl.constexpr = False):
    """acc [BN, BM] += W[BN, 256] @ X[256, BM] for weights in the paired layout (`pair_mxfp4`): pair i of word j
    holds K indices 64i + 2j and 64i + 2j + 1, so each decoded 32-bit pair is already two neighbours along K
    of one sub-block: the register the MMA takes (no byte permutes to build operands, unlike _strided_dot). Sub-block
    i (64 wide) takes the scales of columns 2i and 2i + 1 of s [BN, 8], for its words 0-15 and 16-31. They are
    packed two a column ([BN, 4]) and taken out by masked row reductions: in the sm_90 SASS, per-column loads or a
    split per sub-block instead put the scales in a layout that costs a byte permute per operand register, and
    packing halves the reductions (2.99 instructions a weight in the gate/up loop, against 3.04 unpacked).
    L2_ONLY: the activations are read past L1 (written by programs still running: _await_rows).

    LANE: weights in lane_mxfp4's layout, the same bits on K permuted (mxfp4.LANE_ORDER) so that in the MMA's
    operand layout, lane q of each quad holds K from scale groups 2q and 2q + 1 only (sub-blocks 0-1 and 2-3). Each
    thread then loads its own 4 scale bytes of the [BN, 8] tile; no row reductions or shuffles build the
    multipliers. The activations come in the same order (the build permutes the rows of the GEMM that makes them;
    the gate/up kernel stores h in it). ASM (CUDA): the scale multiply as one packed bf16x2 multiply per register.
    Written as a Triton product, LLVM splits about half of the lane layout's into scalar multiplies and byte
    permutes (sm_90 SASS of the gate/up loop: 802 instructions a K step against 682); ROCm and the interpreter take
    the product."""
    BF16: tl.constexpr = DTYPE == tl.bfloat16
    w = w.to(tl.uint32, bitcast=True)
    if LANE:
        sc_lo, sc_hi = tl.split(tl.reshape(_scale(s, BF16), (BN, 4, 2)))                 # groups 2q, 2q + 1
    else:
        s_even, s_odd = tl.split(tl.reshape(s, (BN, 4, 2)))
        s2 = s_even.to(tl.int32) | (s_odd.to(tl.int32) << 8)                             # [BN, 4]: 2i | 2i+1 << 8
        col = tl.arange(0, 4)[None, :]
    r64 = tl.arange(0, 64)
    for i in tl.static_range(4):
        if LANE:
            sc = sc_lo if i < 2 else sc_hi
            sc64 = tl.reshape(tl.broadcast_to(sc[:, None, :, None], (BN, 8, 4, 2)), (BN, 64))  # col 8a+2q+b: sc[q]
        else:
            both = tl.max(tl.where(col == i, s2, 0), 1)                                  # [BN]
            s_a = _scale(both & 0xFF, BF16)                                              # group 2i
            s_b = _scale(both >> 8, BF16)                                                # group 2i + 1
            sc64 = tl.reshape(tl.broadcast_to(tl.join(s_a, s_b)[:, :, None], (BN, 2, 32)), (BN, 64))
        lo, hi = _halves(_paired_codes(w, i), BF16)  # bf16, or fp32 for fp32/fp16 activations (as the scales)
        vals = tl.reshape(tl.join(lo, hi), (BN, 64))
        if ASM and BF16:
            vals = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [vals, sc64], dtype=tl.bfloat16,
                                             is_pure=True, pack=2)
        else:
            vals = (vals * sc64).to(DTYPE)
        x = tl.load(xT_ptrs + (k0 + 64 * i) + r64[:, None], mask=x_mask, other=0.0,
                    cache_modifier=".cg" if L2_ONLY else "")
        acc = tl.dot(vals, x, acc)
    return acc


@triton.jit
def _fp8_dot(acc, w, s, s_row, zT_ptrs, x_mask, k0, BN: tl.constexpr, SUB: tl.constexpr, F8: tl.constexpr):
    """acc [BN, BM] += W[BN, 8·SUB] @ Z[8·SUB, BM] in F8, weights in the strided layout: sub-block q of the tile
    (nibble q of each word) is code × 2^(s[:, q] − s_row) in F8, via fp16 (× 2^(d + 14), d clamped at −28)."""
    d = tl.maximum(s.to(tl.int32) - s_row[:, None], -28)                                  # [BN, 8], <= 0
    mult = ((d + 29) << 10).to(tl.uint16).to(tl.float16, bitcast=True)                   # 2^(d + 14)
    return _strided_dot(acc, w, mult, zT_ptrs, x_mask, k0, BN, SUB, F8, True)


@triton.jit
def _row_exponent(s_ptrs, Dl, BN: tl.constexpr, BK: tl.constexpr):
    """Each weight row's largest E8M0 scale byte over all of K (int32 [BN]): the FP8 path's reference exponent."""
    best = tl.zeros((BN,), dtype=tl.int32)
    for k0 in range(0, Dl, BK):
        best = tl.maximum(best, tl.max(tl.load(s_ptrs + k0 // 32).to(tl.int32), 1))
    return best


TILE_ROWS = tl.constexpr(mxfp4.TILE_ROWS)  # rows of a tile in mxfp4.tile_rows' layout


@triton.jit
def _row_offsets(offs_n, stride_n, TILE_K: tl.constexpr, TILED: tl.constexpr):
    """Where rows offs_n start, in elements. Row-major: n · stride_n. TILED (mxfp4.tile_rows): the rows of a tile of
    TILE_ROWS sit side by side, TILE_K elements each, one K tile after the other; the K loop then steps by a whole
    tile (K offsets × TILE_ROWS)."""
    if TILED:
        return (offs_n // TILE_ROWS) * TILE_ROWS * stride_n + (offs_n % TILE_ROWS) * TILE_K
    return offs_n * stride_n


@triton.jit
def _program(BN: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """(expert, its rows) of this program: grid (experts, row blocks), or (row blocks, experts) ROWS_FIRST."""
    if ROWS_FIRST:
        return tl.program_id(1), tl.program_id(0) * BN + tl.arange(0, BN)
    return tl.program_id(0), tl.program_id(1) * BN + tl.arange(0, BN)


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs (CUDA's prefetch.global.L2: no register written, nothing waited for)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _signal_rows(done_ptr, e):
    """This program's rows of expert e are stored: count it in done[e] (a release after the whole program's stores,
    so that a program that sees the count also sees the rows)."""
    tl.debug_barrier()
    tl.atomic_add(done_ptr + e, 1, sem="release")


@triton.jit
def _await_rows(done_ptr, e, programs):
    """Wait until `programs` programs of the previous kernel have signalled expert e (_signal_rows)."""
    seen = tl.atomic_add(done_ptr + e, 0, sem="acquire")
    while seen < programs:
        seen = tl.atomic_add(done_ptr + e, 0, sem="acquire")


@triton.jit
def moe_gate_up_kernel(z_ptr, zs_ptr, w_ptr, s_ptr, h_ptr, sorted_ptr, offs_ptr, Dl, I, stride_zm, stride_we,
                       stride_wn, stride_se, stride_sn, stride_hm, beta, linear_beta, TOP_K: tl.constexpr,
                       ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       W4: tl.constexpr, STRIDED: tl.constexpr, F8: tl.constexpr, TILED: tl.constexpr = False,
                       ROWS_FIRST: tl.constexpr = False, done_ptr=None, SIGNAL: tl.constexpr = False,
                       EARLY: tl.constexpr = False, PDL: tl.constexpr = False, ASM: tl.constexpr = False,
                       PREFETCH: tl.constexpr = 0, PREFETCH_PROGRAMS: tl.constexpr = 0):
    """h[pos, n] = act(W1 z, W3 z) for the sorted (token, expert) pairs of one expert (_program).

    W4: z is in swap01 order along Dl and h is written in swap01 order along I (what the down kernel reads).
    STRIDED (with W4, BK = 256): weights in `restride_mxfp4`'s layout (2: `pair_mxfp4`'s), z and h in natural
    order; 4: `lane_mxfp4`'s, z and h in its K order (mxfp4.LANE_ORDER; ASM: _paired_dot's). STRIDED 3
    (experimental FP8 prefill): `restride_mxfp4`'s layout, z in F8 with per-token scales zs
    (`quantize_e4m3`), the weights decoded to F8 against each row's largest scale (_fp8_dot): code ×
    2^(s_group − s_row) is exact in e4m3 while s_group − s_row ≥ −8 and rounds past that, the drift this path
    trades for FP8 tensor cores. The row and token scales multiply the accumulators once, after the K loop.
    zs_ptr and F8 are unused otherwise. TILED (with STRIDED, BN a multiple of TILE_ROWS): weights and scales in
    `tile_rows`' order, so that each K step reads whole contiguous blocks (_row_offsets). ROWS_FIRST: the grid is
    (row blocks, experts) instead of (experts, row blocks), so programs that run together share an expert's tokens.
    SIGNAL: each program with pairs counts itself in done[e] once its rows of h are stored, so that the down kernel
    can start on an expert as soon as its h is whole (moe_down_kernel's AWAIT); EARLY (sm_90): the down kernel,
    launched with PDL, may take SMs as soon as every program of this one has started. PREFETCH (CUDA, launched with
    PDL behind the sort): ask L2 for the program's first PREFETCH K steps of weights and scales before waiting for the
    sort, whose pairs nothing here needs to find them, so that HBM is busy while the sort runs (_prefetch_l2); with
    PREFETCH_PROGRAMS > 0 only the grid's first that many programs (in launch order) do.
    """
    e, offs_n = _program(BN, ROWS_FIRST)
    WK: tl.constexpr = BK // 8 if W4 else BK // 2  # weight elements (words or bytes) per K step
    KMUL: tl.constexpr = TILE_ROWS if TILED else 1  # a K offset's multiplier (tiled: a K step skips a whole tile)
    wg_rows = w_ptr + e * stride_we + _row_offsets(offs_n, stride_wn, WK, TILED)  # [BN]: where each row starts
    sg_rows = s_ptr + e * stride_se + _row_offsets(offs_n, stride_sn, BK // 32, TILED)
    if PREFETCH_PROGRAMS == 0 or tl.program_id(0) + tl.program_id(1) * tl.num_programs(0) < PREFETCH_PROGRAMS:
        for i in tl.static_range(PREFETCH):  # one line a row of each K step (WK words: 128 bytes with W4 and BK 256)
            _prefetch_l2(wg_rows + i * WK * KMUL)
            _prefetch_l2(wg_rows + I * stride_wn + i * WK * KMUL)
            _prefetch_l2(sg_rows + i * (BK // 32) * KMUL)
            _prefetch_l2(sg_rows + I * stride_sn + i * (BK // 32) * KMUL)
    pdl_prologue(PDL or EARLY)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    # activation rows a load adds itself
    RK: tl.constexpr = 1 if STRIDED == 2 or STRIDED == 4 else (BK // 8 if STRIDED else BK)
    rk = tl.arange(0, RK)
    wg_ptrs = wg_rows[:, None] + tl.arange(0, WK)[None, :]
    wu_ptrs = wg_ptrs + I * stride_wn
    sg_ptrs = sg_rows[:, None] + tl.arange(0, BK // 32)[None, :]
    su_ptrs = sg_ptrs + I * stride_sn
    if STRIDED == 4:
        h_cols = _lane_pos(offs_n)
    elif W4 and not STRIDED:
        h_cols = swap01(offs_n)
    else:
        h_cols = offs_n
    if STRIDED == 3:
        sg_row = _row_exponent(sg_ptrs, Dl, BN, BK)
        su_row = _row_exponent(su_ptrs, Dl, BN, BK)
    m0 = start
    while m0 < end:  # a while loop: the interpreter cannot range() over loaded bounds
        offs_p = m0 + tl.arange(0, BM)
        p_mask = offs_p < end
        tok = tl.load(sorted_ptr + offs_p, mask=p_mask, other=0) // TOP_K
        z_ptrs = z_ptr + tok[None, :] * stride_zm + rk[:, None]
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, Dl, BK):  # num_stages pipelines these loads
            kw = (k0 // 8 if W4 else k0 // 2) * KMUL
            ks = k0 // 32 * KMUL
            if STRIDED == 3:
                acc_g = _fp8_dot(acc_g, tl.load(wg_ptrs + kw), tl.load(sg_ptrs + ks), sg_row, z_ptrs,
                                 p_mask[None, :], k0, BN, BK // 8, F8)
                acc_u = _fp8_dot(acc_u, tl.load(wu_ptrs + kw), tl.load(su_ptrs + ks), su_row, z_ptrs,
                                 p_mask[None, :], k0, BN, BK // 8, F8)
            elif STRIDED == 2 or STRIDED == 4:
                acc_g = _paired_dot(acc_g, tl.load(wg_ptrs + kw), tl.load(sg_ptrs + ks), z_ptrs,
                                    p_mask[None, :], k0, BN, z_ptr.dtype.element_ty, LANE=STRIDED == 4, ASM=ASM)
                acc_u = _paired_dot(acc_u, tl.load(wu_ptrs + kw), tl.load(su_ptrs + ks), z_ptrs,
                                    p_mask[None, :], k0, BN, z_ptr.dtype.element_ty, LANE=STRIDED == 4, ASM=ASM)
            elif STRIDED:
                acc_g = _strided_dot(acc_g, tl.load(wg_ptrs + kw), tl.load(sg_ptrs + ks), z_ptrs,
                                     p_mask[None, :], k0, BN, BK // 8, z_ptr.dtype.element_ty)
                acc_u = _strided_dot(acc_u, tl.load(wu_ptrs + kw), tl.load(su_ptrs + ks), z_ptrs,
                                     p_mask[None, :], k0, BN, BK // 8, z_ptr.dtype.element_ty)
            else:
                zT = tl.load(z_ptrs + k0, mask=p_mask[None, :], other=0.0)             # [BK, BM]
                acc_g = _mx_dot(acc_g, tl.load(wg_ptrs + kw), tl.load(sg_ptrs + ks), zT, BN, BK, W4)
                acc_u = _mx_dot(acc_u, tl.load(wu_ptrs + kw), tl.load(su_ptrs + ks), zT, BN, BK, W4)
        if STRIDED == 3:  # 2^(s_row - 127) from bits, times the token's scale
            zs = tl.load(zs_ptr + tok, mask=p_mask, other=0.0)[None, :]
            acc_g = acc_g * (sg_row << 23).to(tl.float32, bitcast=True)[:, None] * zs
            acc_u = acc_u * (su_row << 23).to(tl.float32, bitcast=True)[:, None] * zs
        a = glu_act(acc_g, acc_u, beta, linear_beta, ACT)
        h_ptrs = h_ptr + offs_p[None, :] * stride_hm + h_cols[:, None]
        tl.store(h_ptrs, a.to(h_ptr.dtype.element_ty), mask=p_mask[None, :])
        m0 += BM
    if SIGNAL and end > start:
        _signal_rows(done_ptr, e)


@triton.jit
def moe_down_kernel(h_ptr, w_ptr, s_ptr, y_ptr, sorted_ptr, offs_ptr, tw_ptr, I, stride_hm, stride_we,
                    stride_wn, stride_se, stride_sn, stride_ym, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, W4: tl.constexpr, STRIDED: tl.constexpr, TILED: tl.constexpr = False,
                    ROWS_FIRST: tl.constexpr = False, done_ptr=None, AWAIT: tl.constexpr = 0,
                    PDL: tl.constexpr = False, ASM: tl.constexpr = False):
    """y[pos, n] = w_pair · (W2 h[pos])[n], fp32, for the pairs of one expert (TILED, ROWS_FIRST: as the gate/up
    kernel's). AWAIT > 0 (with the gate/up kernel's SIGNAL, paired layout): no wait for the whole previous grid;
    a program waits for the AWAIT gate/up programs of its own expert instead and reads h past L1, so that the
    gate/up kernel's last programs and this kernel's first ones run together."""
    pdl_prologue(PDL and AWAIT == 0)
    e, offs_n = _program(BN, ROWS_FIRST)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    if AWAIT:
        if end > start:
            _await_rows(done_ptr, e, AWAIT)
    WK: tl.constexpr = BK // 8 if W4 else BK // 2
    RK: tl.constexpr = 1 if STRIDED == 2 or STRIDED == 4 else (BK // 8 if STRIDED else BK)
    rk = tl.arange(0, RK)
    KMUL: tl.constexpr = TILE_ROWS if TILED else 1
    w_ptrs = w_ptr + e * stride_we + _row_offsets(offs_n, stride_wn, WK, TILED)[:, None] + tl.arange(0, WK)[None, :]
    s_ptrs = (s_ptr + e * stride_se + _row_offsets(offs_n, stride_sn, BK // 32, TILED)[:, None]
              + tl.arange(0, BK // 32)[None, :])
    m0 = start
    while m0 < end:
        offs_p = m0 + tl.arange(0, BM)
        p_mask = offs_p < end
        h_ptrs = h_ptr + offs_p[None, :] * stride_hm + rk[:, None]
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, I, BK):
            kw = (k0 // 8 if W4 else k0 // 2) * KMUL
            ks = k0 // 32 * KMUL
            if STRIDED == 2 or STRIDED == 4:
                acc = _paired_dot(acc, tl.load(w_ptrs + kw), tl.load(s_ptrs + ks), h_ptrs, p_mask[None, :], k0,
                                  BN, h_ptr.dtype.element_ty, AWAIT > 0, STRIDED == 4, ASM)
            elif STRIDED:
                acc = _strided_dot(acc, tl.load(w_ptrs + kw), tl.load(s_ptrs + ks), h_ptrs, p_mask[None, :],
                                   k0, BN, BK // 8, h_ptr.dtype.element_ty)
            else:
                hT = tl.load(h_ptrs + k0, mask=p_mask[None, :], other=0.0)             # [BK, BM]
                acc = _mx_dot(acc, tl.load(w_ptrs + kw), tl.load(s_ptrs + ks), hT, BN, BK, W4)
        pair = tl.load(sorted_ptr + offs_p, mask=p_mask, other=0)
        acc = acc * tl.load(tw_ptr + pair, mask=p_mask, other=0.0)[None, :]
        tl.store(y_ptr + offs_p[None, :] * stride_ym + offs_n[:, None], acc, mask=p_mask[None, :])
        m0 += BM


@triton.jit
def sort_pairs_kernel(ids_ptr, order_ptr, offs_ptr, inv_ptr, P, expert_start, E, BLOCK: tl.constexpr,
                      COLS: tl.constexpr, done_ptr=None, ZERO_DONE: tl.constexpr = False, PDL: tl.constexpr = False,
                      EARLY: tl.constexpr = False):
    """Counting sort of the (token, expert) pairs by local expert, program e owning expert e (program E: the
    pairs of other ranks' experts, marked inv -1 and left out of order). Its start is the count of smaller keys,
    so the programs need nothing from each other; within an expert, pairs keep their order (a prefix sum, taken
    only on blocks that hold some of its pairs). P <= BLOCK: the pairs are read once. The pairs of a block are
    held as [BLOCK / COLS, COLS] tiles, and the prefix sum is taken over the rows' counts, then inside each row.
    COLS 1 is a flat scan (the kernel before took one too, in other code); at COLS 4 the kernel's sm_90 code is
    about a third shorter (static instructions, compiled on a CPU, at BLOCK 8192 in 8 warps and 512 in 4). Not
    timed yet: at 8192 pairs each program issues a long straight run of them on its SM, where that may matter.
    ZERO_DONE: also zero done[e], the gate/up kernel's count of finished programs (SIGNAL). EARLY (sm_90, without
    PDL): let the next kernel, launched with PDL, take SMs at once (its programs wait for this grid: PREFETCH)."""
    pdl_prologue(PDL)
    if EARLY and not PDL:
        gdc_launch_dependents()
    e = tl.program_id(0)
    if ZERO_DONE:
        if e < E:
            tl.store(done_ptr + e, 0)
    offs = tl.arange(0, BLOCK // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    if P <= BLOCK:
        key = _local_key(ids_ptr, offs, P, expert_start, E)
        start = _count(key < e)
        tl.store(offs_ptr + e, start)
        _place(order_ptr, inv_ptr, offs, key, e, E, start)
    else:
        start = 0
        for c0 in range(0, P, BLOCK):  # pass 1: how many pairs sort before expert e
            start += _count(_local_key(ids_ptr, c0 + offs, P, expert_start, E) < e)
        tl.store(offs_ptr + e, start)  # program E stores offsets[E], the count of local pairs
        for c0 in range(0, P, BLOCK):  # pass 2: place expert e's pairs
            start = _place(order_ptr, inv_ptr, c0 + offs, _local_key(ids_ptr, c0 + offs, P, expert_start, E), e,
                           E, start)


@triton.jit
def _local_key(ids_ptr, p, P, expert_start, E):
    """The local expert of pairs p (E: another rank's, or past P)."""
    key = tl.load(ids_ptr + p, mask=p < P, other=0) - expert_start
    return tl.where((key >= 0) & (key < E) & (p < P), key, E + (p >= P).to(tl.int32))


@triton.jit
def _count(x):
    """How many of the [rows, COLS] tile x are true."""
    return tl.sum(tl.sum(x.to(tl.int32), axis=1), axis=0)


@triton.jit
def _place(order_ptr, inv_ptr, p, key, e, E, start):
    """Store expert e's pairs among the [rows, COLS] tile p from sorted position `start` on (program E: mark them
    inv -1); returns the next position."""
    hit = key == e
    if e == E:
        tl.store(inv_ptr + p, -1, mask=hit)
    else:
        h = hit.to(tl.int32)
        row = tl.sum(h, axis=1)
        n = tl.sum(row, axis=0)
        if n > 0:
            pos = start + (tl.cumsum(row, axis=0) - row)[:, None] + tl.cumsum(h, axis=1) - 1
            tl.store(order_ptr + pos, p, mask=hit)
            tl.store(inv_ptr + p, pos, mask=hit)
            start += n
    return start


@triton.jit
def moe_combine_kernel(y_ptr, inv_ptr, out_ptr, Dl, stride_ym, stride_om, TOP_K: tl.constexpr, BD: tl.constexpr,
                       GATHER: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[t] = Σ_j y[inv[t, j]] over the token's local pairs (inv < 0: not local); fixed order, deterministic.
    GATHER: the token's TOP_K positions are loaded at once and its local rows gathered together, then summed as
    one [TOP_K, BD] tile (another order than the loop's: not the same bits). Without it, the sm_90 code (compiled
    on a CPU) loads each position only after the previous row's add: TOP_K rounds of a position load, then its
    row's load."""
    pdl_prologue(PDL)
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_mask = offs_d < Dl
    if GATHER:
        KP: tl.constexpr = triton.next_power_of_2(TOP_K)
        j = tl.arange(0, KP)
        pos = tl.load(inv_ptr + t * TOP_K + j, mask=j < TOP_K, other=-1)
        rows = tl.load(y_ptr + tl.maximum(pos, 0).to(tl.int64)[:, None] * stride_ym + offs_d[None, :],
                       mask=(pos >= 0)[:, None] & d_mask[None, :], other=0.0)
        acc = tl.sum(rows.to(tl.float32), axis=0)
    else:
        acc = tl.zeros((BD,), dtype=tl.float32)
        for j in range(TOP_K):
            pos = tl.load(inv_ptr + t * TOP_K + j)
            if pos >= 0:
                acc += tl.load(y_ptr + pos.to(tl.int64) * stride_ym + offs_d, mask=d_mask, other=0.0)
    tl.store(out_ptr + t * stride_om + offs_d, acc, mask=d_mask)


@triton.jit
def mxfp4_dequant_kernel(w_ptr, s_ptr, out_ptr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """out[r, k] = E2M1(w[r, k]) · 2^(s[r, k/32] − 127) for a [rows, K] matrix (rows % BR == 0); w as int32
    words, the result stored back in natural K order."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    k0 = tl.program_id(1) * BK
    w = tl.load(w_ptr + offs_r[:, None] * (K // 8) + k0 // 8 + tl.arange(0, BK // 8)[None, :])
    s = tl.load(s_ptr + offs_r[:, None] * (K // 32) + k0 // 32 + tl.arange(0, BK // 32)[None, :])
    out = _dequant_w4(w, s, BR, BK, out_ptr.dtype.element_ty)
    # undo swap01 inside each thread's registers (tile [.., a, b, c] holds k = 4a + 2c + b), so the store stays
    # contiguous (a scattered store ran 12x slower on the H200)
    out = tl.reshape(tl.permute(tl.reshape(out, (BR, BK // 4, 2, 2)), (0, 1, 3, 2)), (BR, BK))
    tl.store(out_ptr + offs_r[:, None] * K + k0 + tl.arange(0, BK)[None, :], out)
