"""Attention Residuals in one Triton kernel, same signature and semantics as `reference.attn_res`.

A token a program: the score of each candidate (the K block snapshots, then the running sum) is
(v · w⊙p) · rsqrt(mean(v²) + eps), which equals the reference's RMS-normed key times the query; the softmax over
depth and the weighted sum follow in a second pass over the candidates (L2-resident by then). All math in fp32.
The reference's concatenated [K+1, M, D] fp32 copy and its ten launches become one kernel, and the snapshots are
read where the graph left them (up to MAX_BLOCK_PTRS pointers), not stacked into a copy first. With `out_norm`
the graph's next RMSNorm is applied to the output in the same launch (NORM), as norm/triton.py computes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from k3plugins.norm.triton import rms_norm, rms_norm_row, row_warps
from k3plugins.pdl import pdl, pdl_prologue


@triton.jit
def _score(v, q, D, eps):
    return tl.sum(v * q, 0) * tl.rsqrt(tl.sum(v * v, 0) / D + eps)


MAX_BLOCK_PTRS = 8  # snapshots passed as separate pointers (K3 has at most 8); more are stacked first


@triton.jit
def _block(i: tl.constexpr, b0, b1, b2, b3, b4, b5, b6, b7, stride_bk, STACKED: tl.constexpr):
    """Base pointer of snapshot i: b0 + i·stride_bk when the snapshots are one stacked tensor, else pointer i."""
    if STACKED:
        return b0 + i * stride_bk
    elif i == 0:
        return b0
    elif i == 1:
        return b1
    elif i == 2:
        return b2
    elif i == 3:
        return b3
    elif i == 4:
        return b4
    elif i == 5:
        return b5
    elif i == 6:
        return b6
    else:
        return b7


@triton.jit
def _candidate(i: tl.constexpr, K: tl.constexpr, partial_ptr, b0, b1, b2, b3, b4, b5, b6, b7, m, stride_pm,
               stride_bk, stride_bm, offs, mask, STACKED: tl.constexpr):
    """Candidate i's values at `offs` of token m in fp32: snapshot i, or the running sum for i == K."""
    if i == K:
        row = partial_ptr + m * stride_pm
    else:
        row = _block(i, b0, b1, b2, b3, b4, b5, b6, b7, stride_bk, STACKED) + m * stride_bm
    return tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _running_sum(K: tl.constexpr, partial_ptr, delta_ptr, sum_ptr, b0, b1, b2, b3, b4, b5, b6, b7, m, stride_pm,
                 stride_bk, stride_bm, offs, mask, STACKED: tl.constexpr, DELTA: tl.constexpr):
    """The last candidate in fp32: the running sum, or with DELTA (the graph's residual add fused here) partial +
    delta rounded to the activations' dtype as the add would be, and stored to sum_ptr. partial, delta and sum share
    the row stride."""
    p = _candidate(K, K, partial_ptr, b0, b1, b2, b3, b4, b5, b6, b7, m, stride_pm, stride_bk, stride_bm, offs, mask,
                   STACKED)
    if DELTA:
        p = p + tl.load(delta_ptr + m * stride_pm + offs, mask=mask, other=0.0).to(tl.float32)
        p = p.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + m * stride_pm + offs, p, mask=mask)
        p = p.to(tl.float32)
    return p


@triton.jit
def _out_norm(h, partial_ptr, out_norm_ptr, offs, mask, D, out_eps):
    """The RMSNorm that follows the op (NORM), on the whole output row h in fp32, as norm/triton.py's
    rms_norm_kernel computes it on the stored output: h rounded to the activations' dtype first. Masked lanes of h
    must be 0."""
    dtype = partial_ptr.dtype.element_ty
    return rms_norm_row(h.to(dtype).to(tl.float32), out_norm_ptr, offs, mask, D, out_eps, dtype)


@triton.jit
def attn_res_kernel(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, proj_ptr,
                    norm_w_ptr, out_ptr, D, stride_pm, stride_bk, stride_bm, stride_om, eps, K: tl.constexpr,
                    STACKED: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, delta_ptr=None, sum_ptr=None,
                    DELTA: tl.constexpr = False, out_norm_ptr=None, out_eps=1e-5, NORM: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    mask = offs < D
    q = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * \
        tl.load(proj_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = _running_sum(K, partial_ptr, delta_ptr, sum_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr,
                     b7_ptr, m, stride_pm, stride_bk, stride_bm, offs, mask, STACKED, DELTA)
    s_partial = _score(p, q, D, eps)
    rk = tl.arange(0, BK)
    scores = tl.full((BK,), float("-inf"), tl.float32)
    for i in tl.static_range(K):
        v = _candidate(i, K, partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, m,
                       stride_pm, stride_bk, stride_bm, offs, mask, STACKED)
        scores = tl.where(rk == i, _score(v, q, D, eps), scores)
    top = tl.maximum(tl.max(scores, 0), s_partial)
    e = tl.exp(scores - top)  # exp(-inf) = 0 past K
    e_partial = tl.exp(s_partial - top)
    acc = e_partial * p
    for i in tl.static_range(K):
        v = _candidate(i, K, partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, m,
                       stride_pm, stride_bk, stride_bm, offs, mask, STACKED)
        acc += tl.sum(tl.where(rk == i, e, 0.0), 0) * v
    out = acc / (tl.sum(e, 0) + e_partial)
    if NORM:
        out = _out_norm(out, partial_ptr, out_norm_ptr, offs, mask, D, out_eps)
    tl.store(out_ptr + m * stride_om + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def attn_res_partials_kernel(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, proj_ptr,
                             norm_w_ptr, part_ptr, D, stride_pm, stride_bk, stride_bm, K: tl.constexpr,
                             STACKED: tl.constexpr, CH: tl.constexpr, BK: tl.constexpr, delta_ptr=None, sum_ptr=None,
                             DELTA: tl.constexpr = False, PDL: tl.constexpr = False):
    """Split over D, first pass: for token program_id(0) and chunk program_id(1) of CH values, each candidate's
    v·(w⊙p) and v·v over the chunk, to part [M, chunks, 2, BK]. One warp a chunk: warp reductions, no barrier.
    DELTA: this chunk of the new running sum is written too (_running_sum), for the second pass to read."""
    pdl_prologue(PDL)
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CH + tl.arange(0, CH)
    mask = offs < D
    q = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * \
        tl.load(proj_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rk = tl.arange(0, BK)
    dots = tl.zeros((BK,), tl.float32)
    squares = tl.zeros((BK,), tl.float32)
    for i in tl.static_range(K + 1):
        if i == K:
            v = _running_sum(K, partial_ptr, delta_ptr, sum_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr,
                             b6_ptr, b7_ptr, m, stride_pm, stride_bk, stride_bm, offs, mask, STACKED, DELTA)
        else:
            v = _candidate(i, K, partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, m,
                           stride_pm, stride_bk, stride_bm, offs, mask, STACKED)
        dots = tl.where(rk == i, tl.sum(v * q, 0), dots)
        squares = tl.where(rk == i, tl.sum(v * v, 0), squares)
    out = part_ptr + (m * tl.num_programs(1) + c) * 2 * BK + rk
    tl.store(out, dots)
    tl.store(out + BK, squares)


@triton.jit
def attn_res_mix_kernel(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, part_ptr,
                        out_ptr, D, stride_pm, stride_bk, stride_bm, stride_om, eps, K: tl.constexpr,
                        STACKED: tl.constexpr, CH: tl.constexpr, BK: tl.constexpr, CHUNKS: tl.constexpr,
                        BC: tl.constexpr, out_norm_ptr=None, out_eps=1e-5, NORM: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    """Split over D, second pass: the chunks' partials summed in chunk order into the scores, the softmax over
    depth, and this chunk of the weighted sum of the candidates. NORM: the RMSNorm that follows, which needs the
    whole row: launched with one chunk a token (CH >= D) and more warps, which sum the chunks' partial scores in
    another order (the last bits of the weights differ from the chunked programs')."""
    pdl_prologue(PDL)
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    rc = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    at = part_ptr + (m * CHUNKS + rc[:, None]) * 2 * BK + rk[None, :]
    ok = (rc < CHUNKS)[:, None]
    dots = tl.sum(tl.load(at, mask=ok, other=0.0), 0)
    squares = tl.sum(tl.load(at + BK, mask=ok, other=0.0), 0)
    scores = tl.where(rk <= K, dots * tl.rsqrt(squares / D + eps), float("-inf"))
    e = tl.exp(scores - tl.max(scores, 0))
    weights = e / tl.sum(e, 0)
    offs = c * CH + tl.arange(0, CH)
    mask = offs < D
    acc = tl.zeros((CH,), tl.float32)
    for i in tl.static_range(K + 1):
        v = _candidate(i, K, partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, m,
                       stride_pm, stride_bk, stride_bm, offs, mask, STACKED)
        acc += tl.sum(tl.where(rk == i, weights, 0.0), 0) * v
    if NORM:
        acc = _out_norm(acc, partial_ptr, out_norm_ptr, offs, mask, D, out_eps)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


SPLIT_CHUNK = 512  # values of D a one-warp program takes in the split form (16 a thread)
NORM_MIX_WARPS = 8  # warps of the split form's mix with the norm fused (one program a token)


def use_split(M: int, K: int) -> int:
    """The form the engine takes for M tokens and K candidates (H200, BENCHMARKS.md): the split form, except at two
    candidates or fewer and 128 tokens or more, where one program a token was 5 % faster (at 8 candidates or 32
    tokens the split form was 13-39 % faster)."""
    return 0 if K <= 2 and M >= 128 else SPLIT_CHUNK


def attn_res(partial: torch.Tensor, blocks: torch.Tensor | Sequence[torch.Tensor], proj: torch.Tensor,
             norm_weight: torch.Tensor, *, eps: float, delta: torch.Tensor | None = None,
             out_norm: torch.Tensor | None = None, out_eps: float = 1e-5,
             split: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See reference.attn_res. partial: [M, D]; blocks: [K, M, D], or K tensors [M, D] (read where they are: the
    executor's snapshots are never stacked into a copy); proj, norm_weight: D values.
    delta: [M, D], added to partial first by the same launches (the graph's residual add: one launch and one read
    of the running sum fewer); then returns (output, partial + delta).
    out_norm: [D], the next RMSNorm's weight, applied to the output by the same launches (one launch and one
    write and read of the output fewer); the split form's second pass then takes one program a token.
    split: 0, one program a token, whose two block-wide reductions per candidate cost a barrier each; else two
    launches over (token, chunk of `split` values of D) programs of one warp, with no barrier; None (the
    engine's call): use_split's choice."""
    M, D = partial.shape if partial.dim() == 2 else (-1, -1)
    if isinstance(blocks, torch.Tensor):
        stacked = blocks.dim() == 3 and tuple(blocks.shape[1:]) == (M, D)
        blocks = list(blocks) if stacked else [blocks]
    if partial.dim() != 2 or any(tuple(b.shape) != (M, D) for b in blocks):
        raise ValueError(f"attn_res (triton): partial [M, D] and blocks [K, M, D] (or K x [M, D]) expected, got "
                         f"{tuple(partial.shape)} and {[tuple(b.shape) for b in blocks]}")
    if delta is not None and delta.shape != partial.shape:
        raise ValueError(f"attn_res (triton): delta must match partial {tuple(partial.shape)}, got "
                         f"{tuple(delta.shape)}")
    K = len(blocks)
    if proj.numel() != D or norm_weight.numel() != D:
        raise ValueError(f"attn_res (triton): proj and norm_weight must hold {D} values")
    if out_norm is not None and out_norm.shape != (D,):
        raise ValueError(f"attn_res (triton): out_norm must be ({D},), got {tuple(out_norm.shape)}")
    if K == 0:  # a softmax over one candidate is exactly 1
        total = partial if delta is None else partial + delta
        out = total if out_norm is None else rms_norm(total, out_norm, eps=out_eps)
        return out if delta is None else (out, total)
    if split is None:
        split = use_split(M, K)
    partial = partial.contiguous()
    blocks = [b.contiguous() for b in blocks]
    many = K > MAX_BLOCK_PTRS
    ptrs = [torch.stack(blocks)] if many else blocks
    ptrs = ptrs + [ptrs[0]] * (MAX_BLOCK_PTRS - len(ptrs))  # unused pointer slots
    fused, normed = {}, {}
    if delta is not None:
        total = torch.empty_like(partial)
        fused = dict(delta_ptr=delta.contiguous(), sum_ptr=total, DELTA=True)
    if out_norm is not None:
        normed = dict(out_norm_ptr=out_norm.contiguous(), out_eps=float(out_eps), NORM=True)
        out = torch.empty(M, D, dtype=torch.promote_types(out_norm.dtype, partial.dtype), device=partial.device)
    else:
        out = torch.empty_like(partial)
    proj, norm_weight = proj.reshape(D).contiguous(), norm_weight.contiguous()
    bd = triton.next_power_of_2(D)
    if M and split:
        chunks, bk = triton.cdiv(D, split), triton.next_power_of_2(K + 1)
        part = torch.empty(M, chunks, 2, bk, dtype=torch.float32, device=partial.device)
        strides = (D, partial.stride(0), M * D, D)
        attn_res_partials_kernel[(M, chunks)](partial, *ptrs, proj, norm_weight, part, *strides, K=K, STACKED=many,
                                              CH=split, BK=bk, **fused, num_warps=1, **pdl(partial))
        # the norm needs the whole row: then one program a token (NORM_MIX_WARPS) mixes every chunk
        mix_chunks, mix_ch, mix_warps = (1, bd, NORM_MIX_WARPS) if normed else (chunks, split, 1)
        attn_res_mix_kernel[(M, mix_chunks)](total if fused else partial, *ptrs, part, out, *strides, out.stride(0),
                                             float(eps), K=K, STACKED=many, CH=mix_ch, BK=bk, CHUNKS=chunks,
                                             BC=triton.next_power_of_2(chunks), **normed, num_warps=mix_warps,
                                             **pdl(partial))
    elif M:
        attn_res_kernel[(M,)](partial, *ptrs, proj, norm_weight, out, D,
                              partial.stride(0), M * D, D, out.stride(0), float(eps), K=K, STACKED=many, BD=bd,
                              BK=triton.next_power_of_2(K), **fused, **normed, num_warps=row_warps(bd),
                              **pdl(partial))
    return (out, total) if fused else out
