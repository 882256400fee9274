"""Attention Residuals in one Triton kernel, same signature and semantics as `reference.attn_res`.

A token a program: the score of each candidate (the K block snapshots, then the running sum) is
(v · w⊙p) · rsqrt(mean(v²) + eps), which equals the reference's RMS-normed key times the query; the softmax over
depth and the weighted sum follow in a second pass over the candidates (L2-resident by then). All math in fp32.
The reference's concatenated [K+1, M, D] fp32 copy and its ten launches become one kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _score(v, q, D, eps):
    return tl.sum(v * q, 0) * tl.rsqrt(tl.sum(v * v, 0) / D + eps)


@triton.jit
def attn_res_kernel(partial_ptr, blocks_ptr, proj_ptr, norm_w_ptr, out_ptr, K, D, stride_pm, stride_bk, stride_bm,
                    stride_om, eps, BD: tl.constexpr, BK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    mask = offs < D
    q = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * \
        tl.load(proj_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(partial_ptr + m * stride_pm + offs, mask=mask, other=0.0).to(tl.float32)
    s_partial = _score(p, q, D, eps)
    rk = tl.arange(0, BK)
    scores = tl.full((BK,), float("-inf"), tl.float32)
    for i in range(K):
        v = tl.load(blocks_ptr + i * stride_bk + m * stride_bm + offs, mask=mask, other=0.0).to(tl.float32)
        scores = tl.where(rk == i, _score(v, q, D, eps), scores)
    top = tl.maximum(tl.max(scores, 0), s_partial)
    e = tl.exp(scores - top)  # exp(-inf) = 0 past K
    e_partial = tl.exp(s_partial - top)
    acc = e_partial * p
    for i in range(K):
        v = tl.load(blocks_ptr + i * stride_bk + m * stride_bm + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(tl.where(rk == i, e, 0.0), 0) * v
    out = acc / (tl.sum(e, 0) + e_partial)
    tl.store(out_ptr + m * stride_om + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def attn_res(partial: torch.Tensor, blocks: torch.Tensor, proj: torch.Tensor, norm_weight: torch.Tensor,
             *, eps: float) -> torch.Tensor:
    """See reference.attn_res. partial: [M, D]; blocks: [K, M, D]; proj, norm_weight: D values."""
    if partial.dim() != 2 or blocks.dim() != 3 or tuple(blocks.shape[1:]) != tuple(partial.shape):
        raise ValueError(f"attn_res (triton): partial [M, D] and blocks [K, M, D] expected, got "
                         f"{tuple(partial.shape)} and {tuple(blocks.shape)}")
    K = blocks.shape[0]
    M, D = partial.shape
    if proj.numel() != D or norm_weight.numel() != D:
        raise ValueError(f"attn_res (triton): proj and norm_weight must hold {D} values")
    if K == 0:
        return partial  # a softmax over one candidate is exactly 1
    partial, blocks = partial.contiguous(), blocks.contiguous()
    out = torch.empty_like(partial)
    if M:
        bd = triton.next_power_of_2(D)
        attn_res_kernel[(M,)](partial, blocks, proj.reshape(D).contiguous(), norm_weight.contiguous(), out, K, D,
                              partial.stride(0), blocks.stride(0), blocks.stride(1), out.stride(0), float(eps),
                              BD=bd, BK=triton.next_power_of_2(K), num_warps=min(16, max(1, bd // 512)))
    return out
