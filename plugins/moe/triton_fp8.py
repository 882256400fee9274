"""FP8-activation gate/up GEMM of the MXFP4 MoE for prefill (experimental: compiled for sm90/gfx942 and checked
against the reference on the GPU only; the Triton interpreter's fp8 casts are not IEEE-exact, so it cannot check it).

The activations are quantized per token to e4m3 (scale amax/448). The weights, in `restride_mxfp4`'s layout, are
decoded in registers to e4m3 against one reference exponent per weight row (the row's largest E8M0 scale): code ×
2^(s_group − s_row) is exact in e4m3 while s_group − s_row ≥ −8 and rounds past that, which is the drift this
tactic trades for FP8 tensor cores. The row and token scales multiply the fp32 accumulator once, after the K loop.
The down GEMM stays W4A16 (`moe_down_kernel`): it is a third of the FLOPs and would need its input requantized.
"""

import triton
import triton.language as tl

from k3plugins.moe.triton_kernels import _strided_dot, _tanh


@triton.jit
def _fp8_dot(acc, w, s, s_row, zT_ptrs, x_mask, k0, BN: tl.constexpr, SUB: tl.constexpr, F8: tl.constexpr):
    """acc [BN, BM] += W[BN, 8·SUB] @ Z[8·SUB, BM] in F8, weights in the strided layout: sub-block q of the tile
    (nibble q of each word) is code × 2^(s[:, q] − s_row) in F8, via fp16 (× 2^(d + 14), d clamped at −28)."""
    d = tl.maximum(s.to(tl.int32) - s_row[:, None], -28)                                  # [BN, 8], <= 0
    mult = ((d + 29) << 10).to(tl.uint16).to(tl.float16, bitcast=True)                   # 2^(d + 14)
    return _strided_dot(acc, w, mult, zT_ptrs, x_mask, k0, BN, SUB, F8, True)


@triton.jit
def moe_gate_up_fp8_kernel(z_ptr, zs_ptr, w_ptr, s_ptr, h_ptr, sorted_ptr, offs_ptr, Dl, I, stride_zm, stride_we,
                           stride_wn, stride_se, stride_sn, stride_hm, beta, linear_beta, TOP_K: tl.constexpr,
                           ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, F8: tl.constexpr):
    """moe_gate_up_kernel's result (STRIDED, BK 256) from F8 activations z [M, Dl] with per-token scales zs [M]."""
    BK: tl.constexpr = 256
    SUB: tl.constexpr = 32
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    wg_ptrs = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + tl.arange(0, BK // 8)[None, :]
    wu_ptrs = wg_ptrs + I * stride_wn
    sg_ptrs = s_ptr + e * stride_se + offs_n[:, None] * stride_sn + tl.arange(0, BK // 32)[None, :]
    su_ptrs = sg_ptrs + I * stride_sn
    # each row's reference exponent: its largest scale byte over all of K
    sg_row = tl.zeros((BN,), dtype=tl.int32)
    su_row = tl.zeros((BN,), dtype=tl.int32)
    for k0 in range(0, Dl, BK):
        sg_row = tl.maximum(sg_row, tl.max(tl.load(sg_ptrs + k0 // 32).to(tl.int32), 1))
        su_row = tl.maximum(su_row, tl.max(tl.load(su_ptrs + k0 // 32).to(tl.int32), 1))
    # 2^(s_row - 127), from bits (row scales up to 254 are finite in fp32)
    g_row = (sg_row << 23).to(tl.float32, bitcast=True)
    u_row = (su_row << 23).to(tl.float32, bitcast=True)
    rk = tl.arange(0, SUB)
    m0 = start
    while m0 < end:
        offs_p = m0 + tl.arange(0, BM)
        p_mask = offs_p < end
        tok = tl.load(sorted_ptr + offs_p, mask=p_mask, other=0) // TOP_K
        z_ptrs = z_ptr + tok[None, :] * stride_zm + rk[:, None]
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, Dl, BK):
            acc_g = _fp8_dot(acc_g, tl.load(wg_ptrs + k0 // 8), tl.load(sg_ptrs + k0 // 32), sg_row, z_ptrs,
                             p_mask[None, :], k0, BN, SUB, F8)
            acc_u = _fp8_dot(acc_u, tl.load(wu_ptrs + k0 // 8), tl.load(su_ptrs + k0 // 32), su_row, z_ptrs,
                             p_mask[None, :], k0, BN, SUB, F8)
        zs = tl.load(zs_ptr + tok, mask=p_mask, other=0.0)[None, :]
        acc_g = acc_g * g_row[:, None] * zs
        acc_u = acc_u * u_row[:, None] * zs
        if ACT == 0:  # SiTU
            a = beta * _tanh(acc_g / beta) * tl.sigmoid(acc_g) * (linear_beta * _tanh(acc_u / linear_beta))
        else:  # SiLU-GLU
            a = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + offs_p[None, :] * stride_hm + offs_n[:, None], a.to(h_ptr.dtype.element_ty),
                 mask=p_mask[None, :])
        m0 += BM
