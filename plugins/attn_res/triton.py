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

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3plugins.counts import await_count, signal_count
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
def _chunk_stats(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, proj_ptr, norm_w_ptr,
                 part_ptr, m, c, chunks, D, stride_pm, stride_bk, stride_bm, K: tl.constexpr, STACKED: tl.constexpr,
                 CH: tl.constexpr, BK: tl.constexpr, delta_ptr, sum_ptr, DELTA: tl.constexpr, gram_ptr=None,
                 GRAM: tl.constexpr = False):
    """For token m and chunk c of CH values: each candidate's v·(w⊙p) and v·v over the chunk, to part[m, c] (of
    [M, chunks, 2, BK]). DELTA: this chunk of the new running sum is written too (_running_sum). GRAM: also every
    pair's v_i·v_j over the chunk, to gram[m, c] (of [M, chunks, BK, BK]; i <= j only), from which the output's
    sum of squares follows once the weights are known."""
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
        if GRAM:
            cross = tl.zeros((BK,), tl.float32)
            for j in tl.static_range(i):
                u = _candidate(j, K, partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, m,
                               stride_pm, stride_bk, stride_bm, offs, mask, STACKED)
                cross = tl.where(rk == j, tl.sum(u * v, 0), cross)
            cross = tl.where(rk == i, tl.sum(v * v, 0), cross)
            tl.store(gram_ptr + ((m * chunks + c) * BK + i) * BK + rk, cross)
    out = part_ptr + (m * chunks + c) * 2 * BK + rk
    tl.store(out, dots)
    tl.store(out + BK, squares)


@triton.jit
def _weights(part_ptr, m, D, eps, K: tl.constexpr, BK: tl.constexpr, CHUNKS: tl.constexpr, BC: tl.constexpr):
    """Token m's softmax weights over depth [BK] (0 past K): its chunks' partials summed in chunk order into the
    scores."""
    rc = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    at = part_ptr + (m * CHUNKS + rc[:, None]) * 2 * BK + rk[None, :]
    ok = (rc < CHUNKS)[:, None]
    # past L1: in the synced form other programs of this launch stored them
    dots = tl.sum(tl.load(at, mask=ok, other=0.0, cache_modifier=".cg"), 0)
    squares = tl.sum(tl.load(at + BK, mask=ok, other=0.0, cache_modifier=".cg"), 0)
    scores = tl.where(rk <= K, dots * tl.rsqrt(squares / D + eps), float("-inf"))
    e = tl.exp(scores - tl.max(scores, 0))
    return e / tl.sum(e, 0)


@triton.jit
def _chunk_mix(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, part_ptr, m, c, D,
               stride_pm, stride_bk, stride_bm, eps, K: tl.constexpr, STACKED: tl.constexpr, CH: tl.constexpr,
               BK: tl.constexpr, CHUNKS: tl.constexpr, BC: tl.constexpr):
    """Token m's chunks' partials summed in chunk order into the scores, the softmax over depth, and chunk c (CH
    values) of the weighted sum of the candidates, in fp32; and the weights."""
    rk = tl.arange(0, BK)
    weights = _weights(part_ptr, m, D, eps, K, BK, CHUNKS, BC)
    offs = c * CH + tl.arange(0, CH)
    mask = offs < D
    acc = tl.zeros((CH,), tl.float32)
    for i in tl.static_range(K + 1):
        v = _candidate(i, K, partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, m,
                       stride_pm, stride_bk, stride_bm, offs, mask, STACKED)
        acc += tl.sum(tl.where(rk == i, weights, 0.0), 0) * v
    return acc, weights


@triton.jit
def attn_res_partials_kernel(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, proj_ptr,
                             norm_w_ptr, part_ptr, D, stride_pm, stride_bk, stride_bm, K: tl.constexpr,
                             STACKED: tl.constexpr, CH: tl.constexpr, BK: tl.constexpr, delta_ptr=None, sum_ptr=None,
                             DELTA: tl.constexpr = False, PDL: tl.constexpr = False):
    """Split over D, first pass: program (token, chunk) stores its chunk's partials (_chunk_stats). One warp a
    chunk: warp reductions, no barrier."""
    pdl_prologue(PDL)
    _chunk_stats(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, proj_ptr, norm_w_ptr,
                 part_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1), D, stride_pm,
                 stride_bk, stride_bm, K, STACKED, CH, BK, delta_ptr, sum_ptr, DELTA)


@triton.jit
def attn_res_mix_kernel(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, part_ptr,
                        out_ptr, D, stride_pm, stride_bk, stride_bm, stride_om, eps, K: tl.constexpr,
                        STACKED: tl.constexpr, CH: tl.constexpr, BK: tl.constexpr, CHUNKS: tl.constexpr,
                        BC: tl.constexpr, out_norm_ptr=None, out_eps=1e-5, NORM: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    """Split over D, second pass: chunk program_id(1) of token program_id(0)'s mix (_chunk_mix). NORM: the RMSNorm
    that follows, which needs the whole row: launched with one chunk a token (CH >= D) and more warps, which sum
    the chunks' partial scores in another order (the last bits of the weights differ from the chunked programs')."""
    pdl_prologue(PDL)
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    acc, _ = _chunk_mix(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, part_ptr, m, c, D,
                     stride_pm, stride_bk, stride_bm, eps, K, STACKED, CH, BK, CHUNKS, BC)
    offs = c * CH + tl.arange(0, CH)
    mask = offs < D
    if NORM:
        acc = _out_norm(acc, partial_ptr, out_norm_ptr, offs, mask, D, out_eps)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def attn_res_synced_kernel(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, proj_ptr,
                           norm_w_ptr, part_ptr, squares_ptr, count_ptr, out_ptr, D, stride_pm, stride_bk, stride_bm,
                           stride_om, eps, K: tl.constexpr, STACKED: tl.constexpr, CH: tl.constexpr,
                           BK: tl.constexpr, CHUNKS: tl.constexpr, BC: tl.constexpr, delta_ptr=None, sum_ptr=None,
                           DELTA: tl.constexpr = False, out_norm_ptr=None, out_eps=1e-5, NORM: tl.constexpr = False,
                           gram_ptr=None, GRAM: tl.constexpr = False, POLL_LOADS: tl.constexpr = False,
                           PHASE: tl.constexpr = 0, PDL: tl.constexpr = False):
    """The split form in one launch: program (chunk, token) stores its chunk's partials, waits until the token's
    CHUNKS programs have (count[token]), then mixes its chunk. NORM: each program stores the sum of squares of its
    chunk of the output (rounded to the activations' dtype, as _out_norm), waits again, and normalises its chunk by
    the whole row's sum (the chunks' sums added in chunk order). The last program of a token to finish zeroes its
    count for the next launch.

    The waits need every program of a token to be running or done while one waits: the chunks are the grid's first
    axis, so a token's programs are launched one after the other, and a GPU that runs at least CHUNKS programs at
    once always has the earliest waiting token's programs in flight. Triton's interpreter runs programs one at a
    time, so there the launch is split at the waits instead: PHASE 1 (the partials), then 2 (the mix; with NORM only
    its sums of squares), then with NORM 3 (the mix again, normalised). PHASE 0 is the one launch.

    GRAM (with NORM): the output's sum of squares from the candidates' chunk Gram matrices and the weights
    (||Σ w_i v_i||² = Σ w_i w_j v_i·v_j), so one wait; the output unrounded, where the norm after a stored output
    sees it rounded. POLL_LOADS: await_count's LOADS."""
    if PDL:
        gdc_wait()
    c = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    count = count_ptr + m
    if PHASE <= 1:
        _chunk_stats(partial_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, proj_ptr,
                     norm_w_ptr, part_ptr, m, c, CHUNKS, D, stride_pm, stride_bk, stride_bm, K, STACKED, CH, BK,
                     delta_ptr, sum_ptr, DELTA, gram_ptr, GRAM)
        if PHASE == 0:
            signal_count(count)
            await_count(count, CHUNKS, POLL_LOADS)
    if PDL:  # every program of this grid is running or done: the next grid may take the SMs left
        gdc_launch_dependents()
    if PHASE != 1:
        mix_partial = sum_ptr if DELTA else partial_ptr
        acc, w = _chunk_mix(mix_partial, b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr, part_ptr, m,
                            c, D, stride_pm, stride_bk, stride_bm, eps, K, STACKED, CH, BK, CHUNKS, BC)
        offs = c * CH + tl.arange(0, CH)
        mask = offs < D
        if NORM and GRAM:
            rk = tl.arange(0, BK)
            ri, rj = rk[:, None], rk[None, :]
            rc = tl.arange(0, BC)[:, None, None]
            at = gram_ptr + ((m * CHUNKS + rc) * BK + ri[None]) * BK + rj[None]
            gram = tl.sum(tl.load(at, mask=(rc < CHUNKS) & ((ri <= K) & (rj <= ri))[None], other=0.0,
                                  cache_modifier=".cg"), 0)
            pairs = tl.where(ri == rj, 1.0, 2.0) * w[:, None] * w[None, :] * gram
            total = tl.sum(tl.sum(pairs, 1), 0)
            acc = acc.to(partial_ptr.dtype.element_ty).to(tl.float32) * tl.rsqrt(total / D + out_eps)
            acc = acc.to(partial_ptr.dtype.element_ty).to(tl.float32) * \
                tl.load(out_norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        elif NORM:
            acc = acc.to(partial_ptr.dtype.element_ty).to(tl.float32)
            if PHASE != 3:
                tl.store(squares_ptr + m * CHUNKS + c, tl.sum(acc * acc, 0))
            if PHASE == 0:
                signal_count(count)
                await_count(count, 2 * CHUNKS, POLL_LOADS)
            if PHASE != 2:
                rc = tl.arange(0, BC)
                total = tl.sum(tl.load(squares_ptr + m * CHUNKS + rc, mask=rc < CHUNKS, other=0.0,
                                        cache_modifier=".cg"), 0)
                acc = acc * tl.rsqrt(total / D + out_eps)
                acc = acc.to(partial_ptr.dtype.element_ty).to(tl.float32) * \
                    tl.load(out_norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        if PHASE == 0 and signal_count(count) == (3 if NORM and not GRAM else 2) * CHUNKS - 1:
            tl.atomic_xchg(count, 0)


SPLIT_CHUNK = 512  # values of D a one-warp program takes in the split form (16 a thread)
SYNCED_MAX_TOKENS = 256  # the split form takes one launch (attn_res_synced_kernel) up to this many tokens
SYNCED_GRAM = True  # its fused norm by the candidates' Gram matrix (one wait, not two)
SYNCED_POLL_LOADS = True  # its waits poll by loads (await_count's LOADS)


def use_split(M: int, K: int) -> int:
    """The form the engine takes for M tokens and K candidates (H200, BENCHMARKS.md): the split form, except at two
    candidates or fewer and 128 tokens or more, where one program a token was 5 % faster (at 8 candidates or 32
    tokens the split form was 13-39 % faster)."""
    return 0 if K <= 2 and M >= 128 else SPLIT_CHUNK


def _side_by_side(t: torch.Tensor) -> bool:
    """Whether the programs of one launch on t's device run side by side (a GPU), so that they may wait for each
    other; Triton's interpreter (CPU tensors) runs them one at a time."""
    return t.is_cuda


_COUNTS: dict[torch.device, torch.Tensor] = {}
COUNT_SLOTS = 4096  # tokens the counts hold: SYNCED_MAX_TOKENS may be raised up to this without a new buffer, which
# would leave graphs captured with the old one pointing at freed memory


def _counts(device: torch.device) -> torch.Tensor | None:
    """The synced form's per-token counts on `device` (zero between launches: each launch leaves them so), made on
    the first call; None when that call is inside a CUDA graph capture, where a zero fill would only run at replay
    (the runtime's warm-up step before capture makes them)."""
    counts = _COUNTS.get(device)
    if counts is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counts = _COUNTS[device] = torch.zeros(COUNT_SLOTS, dtype=torch.int32, device=device)
    return counts


def attn_res(partial: torch.Tensor, blocks: torch.Tensor | Sequence[torch.Tensor], proj: torch.Tensor,
             norm_weight: torch.Tensor, *, eps: float, delta: torch.Tensor | None = None,
             out_norm: torch.Tensor | None = None, out_eps: float = 1e-5,
             split: int | None = None,
             synced: bool | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See reference.attn_res. partial: [M, D]; blocks: [K, M, D], or K tensors [M, D] (read where they are: the
    executor's snapshots are never stacked into a copy); proj, norm_weight: D values.
    delta: [M, D], added to partial first by the same launches (the graph's residual add: one launch and one read
    of the running sum fewer); then returns (output, partial + delta).
    out_norm: [D], the next RMSNorm's weight, applied to the output by the same launches (one launch and one
    write and read of the output fewer); the split form's second pass then takes one program a token.
    split: 0, one program a token, whose two block-wide reductions per candidate cost a barrier each; else two
    launches over (token, chunk of `split` values of D) programs of one warp, with no barrier; None (the
    engine's call): use_split's choice.
    synced: the split form in one launch (attn_res_synced_kernel; its programs wait for each other) rather than
    two; None (the engine's call): up to SYNCED_MAX_TOKENS tokens. Its launches on one device must not run
    concurrently (they share one set of counts): the engine runs a device's launches on one stream."""
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
    one_launch = split and synced is not False and 0 < M <= min(SYNCED_MAX_TOKENS, COUNT_SLOTS)
    counts = _counts(partial.device) if one_launch else None
    if counts is not None:
        chunks, bk = triton.cdiv(D, split), triton.next_power_of_2(K + 1)
        part = torch.empty(M, chunks, 2, bk, dtype=torch.float32, device=partial.device)
        squares = torch.empty(M, chunks, dtype=torch.float32, device=partial.device) if normed else part
        gram = dict(gram_ptr=torch.empty(M, chunks, bk, bk, dtype=torch.float32, device=partial.device),
                    GRAM=True) if normed and SYNCED_GRAM else {}
        args = (partial, *ptrs, proj, norm_weight, part, squares, counts, out, D, partial.stride(0), M * D, D,
                out.stride(0), float(eps))
        kw = dict(K=K, STACKED=many, CH=split, BK=bk, CHUNKS=chunks, BC=triton.next_power_of_2(chunks), **fused,
                  **normed, **gram, POLL_LOADS=SYNCED_POLL_LOADS, num_warps=1)
        if _side_by_side(partial):
            attn_res_synced_kernel[(chunks, M)](*args, **kw, **pdl(partial))
        else:  # Triton's interpreter runs one program at a time: the launch split at its waits
            for phase in (1, 2, 3) if normed and not gram else (1, 2):
                attn_res_synced_kernel[(chunks, M)](*args, **kw, PHASE=phase)
    elif M and split:
        chunks, bk = triton.cdiv(D, split), triton.next_power_of_2(K + 1)
        part = torch.empty(M, chunks, 2, bk, dtype=torch.float32, device=partial.device)
        strides = (D, partial.stride(0), M * D, D)
        attn_res_partials_kernel[(M, chunks)](partial, *ptrs, proj, norm_weight, part, *strides, K=K, STACKED=many,
                                              CH=split, BK=bk, **fused, num_warps=1, **pdl(partial))
        # the norm needs the whole row: then one program of eight warps a token mixes every chunk
        mix_chunks, mix_ch, mix_warps = (1, bd, 8) if normed else (chunks, split, 1)
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
