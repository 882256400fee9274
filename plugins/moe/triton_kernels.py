"""Triton kernels of the MXFP4 grouped MoE (W4A16); the host side is in triton.py.

Weights stay in the build's layout (K3_SPEC.md §3): w13 [E, 2I, Dl/2] u8 (gate rows then up rows),
w2 [E, Dl, I/2] u8, scales [E, rows, K/32] u8 E8M0. Each program owns (expert, BN weight rows) and walks
that expert's tokens BM at a time, so the weights are the MMA's M side (swap-AB: decode has 1-8 tokens
per expert, far below a tensor-core tile) and are read from HBM once per expert.
"""

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # no portable tl.tanh: tanh(x) = 2·sigmoid(2x) − 1
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _e2m1_value(code):
    """int32 code 0..15 -> fp32 value; bit 3 sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    m = code & 7
    e = m >> 1
    mt = (m & 1).to(tl.float32)
    mag = tl.where(e == 0, mt * 0.5, tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * mt))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _dequant(packed, scale, BN: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr):
    """packed u8 [BN, BK/2] (low nibble = even k), scale u8 [BN, BK/32] -> [BN, BK] DTYPE."""
    p = packed.to(tl.int32)
    w = tl.reshape(tl.join(_e2m1_value(p & 15), _e2m1_value(p >> 4)), (BN, BK))
    s = tl.exp2(scale.to(tl.float32) - 127.0)
    w = tl.reshape(tl.reshape(w, (BN, BK // 32, 32)) * s[:, :, None], (BN, BK))
    return w.to(DTYPE)


@triton.jit
def _mx_dot(acc, w, s, xT, BN: tl.constexpr, BK: tl.constexpr, DOT_SCALED: tl.constexpr):
    """acc [BN, BM] += W[BN, BK] @ xT[BK, BM], W as MXFP4 codes w [BN, BK/2] and scales s [BN, BK/32]."""
    if DOT_SCALED:
        # Triton's MX dot: native on MX hardware, upcast-in-registers elsewhere (Hopper, CDNA3)
        acc = tl.dot_scaled(w, s, "e2m1", xT, None, "bf16" if xT.dtype == tl.bfloat16 else "fp16", acc)
    else:
        acc = tl.dot(_dequant(w, s, BN, BK, xT.dtype), xT, acc)
    return acc


@triton.jit
def moe_gate_up_kernel(z_ptr, w_ptr, s_ptr, h_ptr, sorted_ptr, offs_ptr, Dl, I, stride_zm, stride_we, stride_wn,
                       stride_se, stride_sn, stride_hm, beta, linear_beta, TOP_K: tl.constexpr,
                       ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       DOT_SCALED: tl.constexpr):
    """h[pos, n] = act(W1 z, W3 z) for the sorted (token, expert) pairs of expert program_id(0)."""
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    rk = tl.arange(0, BK)
    rkk = tl.arange(0, BK // 2)
    rks = tl.arange(0, BK // 32)
    wg_ptrs = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + rkk[None, :]
    wu_ptrs = wg_ptrs + I * stride_wn
    sg_ptrs = s_ptr + e * stride_se + offs_n[:, None] * stride_sn + rks[None, :]
    su_ptrs = sg_ptrs + I * stride_sn
    m0 = start
    while m0 < end:  # a while loop: the interpreter cannot range() over loaded bounds
        offs_p = m0 + tl.arange(0, BM)
        p_mask = offs_p < end
        tok = tl.load(sorted_ptr + offs_p, mask=p_mask, other=0) // TOP_K
        z_ptrs = z_ptr + tok[None, :] * stride_zm + rk[:, None]
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        zT = tl.load(z_ptrs, mask=p_mask[None, :], other=0.0)                      # [BK, BM]
        wg, sg = tl.load(wg_ptrs), tl.load(sg_ptrs)
        wu, su = tl.load(wu_ptrs), tl.load(su_ptrs)
        for k0 in range(BK, Dl + BK, BK):
            # register prefetch of the next K step (clamped: the last one re-reads a cached tile) so
            # its HBM reads are in flight during this step's dequant and MMA
            # (multiple_of: without it the loads fall to 1 byte each, the alignment of kn // 2 being unknown)
            kn = tl.multiple_of(tl.minimum(k0, Dl - BK), BK)
            kw = tl.multiple_of(kn // 2, BK // 2)
            ks = tl.multiple_of(kn // 32, BK // 32)
            zT_n = tl.load(z_ptrs + kn, mask=p_mask[None, :], other=0.0)
            wg_n, sg_n = tl.load(wg_ptrs + kw), tl.load(sg_ptrs + ks)
            wu_n, su_n = tl.load(wu_ptrs + kw), tl.load(su_ptrs + ks)
            acc_g = _mx_dot(acc_g, wg, sg, zT, BN, BK, DOT_SCALED)
            acc_u = _mx_dot(acc_u, wu, su, zT, BN, BK, DOT_SCALED)
            zT, wg, sg, wu, su = zT_n, wg_n, sg_n, wu_n, su_n
        if ACT == 0:  # SiTU
            a = beta * _tanh(acc_g / beta) * tl.sigmoid(acc_g) * (linear_beta * _tanh(acc_u / linear_beta))
        else:  # SiLU-GLU
            a = acc_g * tl.sigmoid(acc_g) * acc_u
        h_ptrs = h_ptr + offs_p[None, :] * stride_hm + offs_n[:, None]
        tl.store(h_ptrs, a.to(h_ptr.dtype.element_ty), mask=p_mask[None, :])
        m0 += BM


@triton.jit
def moe_down_kernel(h_ptr, w_ptr, s_ptr, y_ptr, sorted_ptr, offs_ptr, tw_ptr, I, stride_hm, stride_we,
                    stride_wn, stride_se, stride_sn, stride_ym, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, DOT_SCALED: tl.constexpr):
    """y[pos, n] = w_pair · (W2 h[pos])[n], fp32, for the pairs of expert program_id(0)."""
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    rk = tl.arange(0, BK)
    w_ptrs = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + tl.arange(0, BK // 2)[None, :]
    s_ptrs = s_ptr + e * stride_se + offs_n[:, None] * stride_sn + tl.arange(0, BK // 32)[None, :]
    m0 = start
    while m0 < end:
        offs_p = m0 + tl.arange(0, BM)
        p_mask = offs_p < end
        h_ptrs = h_ptr + offs_p[None, :] * stride_hm + rk[:, None]
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        hT = tl.load(h_ptrs, mask=p_mask[None, :], other=0.0)                      # [BK, BM]
        w, s = tl.load(w_ptrs), tl.load(s_ptrs)
        for k0 in range(BK, I + BK, BK):
            kn = tl.multiple_of(tl.minimum(k0, I - BK), BK)  # register prefetch, as in the gate/up kernel
            hT_n = tl.load(h_ptrs + kn, mask=p_mask[None, :], other=0.0)
            w_n = tl.load(w_ptrs + tl.multiple_of(kn // 2, BK // 2))
            s_n = tl.load(s_ptrs + tl.multiple_of(kn // 32, BK // 32))
            acc = _mx_dot(acc, w, s, hT, BN, BK, DOT_SCALED)
            hT, w, s = hT_n, w_n, s_n
        pair = tl.load(sorted_ptr + offs_p, mask=p_mask, other=0)
        acc = acc * tl.load(tw_ptr + pair, mask=p_mask, other=0.0)[None, :]
        tl.store(y_ptr + offs_p[None, :] * stride_ym + offs_n[:, None], acc, mask=p_mask[None, :])
        m0 += BM


@triton.jit
def moe_combine_kernel(y_ptr, inv_ptr, out_ptr, Dl, stride_ym, stride_om, TOP_K: tl.constexpr, BD: tl.constexpr):
    """out[t] = Σ_j y[inv[t, j]] over the token's local pairs (inv < 0: not local); fixed order, deterministic."""
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_mask = offs_d < Dl
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in range(TOP_K):
        pos = tl.load(inv_ptr + t * TOP_K + j)
        if pos >= 0:
            acc += tl.load(y_ptr + pos * stride_ym + offs_d, mask=d_mask, other=0.0)
    tl.store(out_ptr + t * stride_om + offs_d, acc, mask=d_mask)


@triton.jit
def mxfp4_dequant_kernel(w_ptr, s_ptr, out_ptr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """out[r, k] = E2M1(w[r, k]) · 2^(s[r, k/32] − 127) for a [rows, K] matrix (rows % BR == 0)."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    k0 = tl.program_id(1) * BK
    w = tl.load(w_ptr + offs_r[:, None] * (K // 2) + k0 // 2 + tl.arange(0, BK // 2)[None, :])
    s = tl.load(s_ptr + offs_r[:, None] * (K // 32) + k0 // 32 + tl.arange(0, BK // 32)[None, :])
    out = _dequant(w, s, BR, BK, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_r[:, None] * K + k0 + tl.arange(0, BK)[None, :], out)
