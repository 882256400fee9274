"""Fused router in Triton, same signature and semantics as `reference.route` (groups must be trivial).

Two launches: fp32 logits x·Wᵀ from bf16 operands (tensor cores, fp32 accumulation), split over experts and
K so a decode batch still spreads over the GPU, written as per-split partials; then per token the partials
summed in a fixed order (deterministic), sigmoid, bias for selection, top-k by one partial bitonic sort,
weights from the unbiased scores, renormalised and scaled.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from k3plugins.pdl import pdl, pdl_prologue


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, part_ptr, M, E, D, stride_xm, stride_we, stride_ps, stride_pm,
                         K_PER_SPLIT, BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """Split ps of the logits of BM tokens × BE experts. SWAP: the experts are the MMA's M side (acc [BE, BM]), so a
    few tokens still fill Hopper's 64-row warpgroup MMA instead of a 16-row one."""
    pdl_prologue(PDL)
    pm = tl.program_id(0)
    pe = tl.program_id(1)
    ps = tl.program_id(2)
    offs_m = pm * BM + tl.arange(0, BM)
    offs_e = pe * BE + tl.arange(0, BE)
    rk = tl.arange(0, BK)
    m_mask = offs_m < M
    e_mask = offs_e < E
    acc = tl.zeros((BE, BM) if SWAP else (BM, BE), dtype=tl.float32)
    k_start = ps * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BK):
        k_mask = (k0 + rk) < D
        if SWAP:
            w = tl.load(w_ptr + offs_e[:, None] * stride_we + (k0 + rk)[None, :],
                        mask=e_mask[:, None] & k_mask[None, :], other=0.0)
            xT = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + rk)[:, None],
                         mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            acc = tl.dot(w, xT, acc)
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + rk)[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + offs_e[None, :] * stride_we + (k0 + rk)[:, None],
                        mask=e_mask[None, :] & k_mask[:, None], other=0.0)
            acc = tl.dot(x, w, acc)
    part = part_ptr + ps * stride_ps
    if SWAP:
        tl.store(part + offs_m[None, :] * stride_pm + offs_e[:, None], acc, mask=m_mask[None, :] & e_mask[:, None])
    else:
        tl.store(part + offs_m[:, None] * stride_pm + offs_e[None, :], acc, mask=m_mask[:, None] & e_mask[None, :])


@triton.jit
def _summed_logits(part_ptr, m, offs, mask, stride_ps, stride_pm, NUM_SPLITS: tl.constexpr):
    """Token m's logits at `offs`: its per-split partials summed in split order (deterministic)."""
    logits = tl.zeros(offs.shape, dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        logits += tl.load(part_ptr + s * stride_ps + m * stride_pm + offs, mask=mask, other=0.0)
    return logits


@triton.jit
def _select(part_ptr, bias_ptr, ids_ptr, wts_ptr, m, E, stride_ps, stride_pm, scaling, NUM_SPLITS: tl.constexpr,
            TOP_K: tl.constexpr, BE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    """Token m's TOP_K largest biased scores by one partial bitonic sort (tl.topk) of int64 keys (the score's bits
    made order-preserving, then the index inverted so the lowest index wins a tie, as a stable sort picks); the
    weights are the unbiased scores of those experts."""
    offs_e = tl.arange(0, BE)
    e_mask = offs_e < E
    choice = tl.sigmoid(_summed_logits(part_ptr, m, offs_e, e_mask, stride_ps, stride_pm, NUM_SPLITS))
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0)
    bits = tl.where(e_mask, choice, float("-inf")).to(tl.int32, bitcast=True)
    key = (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) << 32) | (BE - 1 - offs_e).to(tl.int64)
    ids = (BE - 1) - (tl.topk(key, TOP_K) & 0xFFFFFFFF).to(tl.int32)
    rk = tl.arange(0, TOP_K)
    wts = tl.sigmoid(_summed_logits(part_ptr, m, ids, rk < TOP_K, stride_ps, stride_pm, NUM_SPLITS))
    if RENORM:
        wts = wts / (tl.sum(wts, 0) + 1e-20)
    tl.store(ids_ptr + m * TOP_K + rk, ids.to(tl.int64))
    tl.store(wts_ptr + m * TOP_K + rk, wts * scaling)


@triton.jit
def router_topk_kernel(part_ptr, bias_ptr, ids_ptr, wts_ptr, E, stride_ps, stride_pm, scaling, NUM_SPLITS: tl.constexpr,
                       TOP_K: tl.constexpr, BE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                       h_ptr=None, out_ptr=None, N_CAST=0, stride_h=0, stride_out=0, CAST: tl.constexpr = False,
                       BC: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Program (m, 0) selects token m's experts (_select). CAST (MoEInProj, whose GEMM wrote these logits as the
    last columns of fp32 rows h): programs (m, c > 0) store columns [(c-1)·BC, c·BC) of the row's first N_CAST in
    out's dtype, beside the selection instead of before it in the same program (a loop of dependent loads)."""
    pdl_prologue(PDL)
    m = tl.program_id(0).to(tl.int64)  # MoEInProj's rows are N + E wide: m * stride_pm may pass 2^31
    c = tl.program_id(1)
    if c == 0:
        _select(part_ptr, bias_ptr, ids_ptr, wts_ptr, m, E, stride_ps, stride_pm, scaling, NUM_SPLITS, TOP_K, BE,
                HAS_BIAS, RENORM)
    elif CAST:
        cols = (c - 1) * BC + tl.arange(0, BC)
        v = tl.load(h_ptr + m * stride_h + cols, mask=cols < N_CAST, other=0.0)
        tl.store(out_ptr + m * stride_out + cols, v.to(out_ptr.dtype.element_ty), mask=cols < N_CAST)


def fits(x, gate_weight, top_k, num_expert_group, topk_group) -> tuple[bool, str]:
    """What the kernels need of the inputs, wherever they run (a GPU, or Triton's interpreter in the tests)."""
    ok, why = selection_fits(gate_weight.shape[0], top_k, num_expert_group, topk_group)
    if not ok:
        return ok, why
    if x.dtype not in (torch.bfloat16, torch.float16) or gate_weight.dtype != x.dtype:
        return False, "x and gate_weight must share a bf16/fp16 dtype (fp32 logits come from the accumulator)"
    return True, ""


def selection_fits(num_experts: int, top_k: int, num_expert_group: int, topk_group: int) -> tuple[bool, str]:
    """What the top-k kernel needs: trivial groups, a power-of-two top_k."""
    if num_expert_group != 1 or topk_group != 1:
        return False, "the Triton router implements trivial groups only (K3: 1/1)"
    if top_k & (top_k - 1) or top_k > num_experts:
        return False, f"top_k={top_k} must be a power of two <= {num_experts}"
    return True, ""


class LogitBlocks(NamedTuple):
    """The logits kernel's launch: tiles, K splits (each writes a partial the top-k kernel sums), warps, stages; and
    the top-k kernel's warps (one program a token)."""
    bm: int
    be: int
    bk: int
    splits: int
    warps: int = 4
    stages: int = 3
    swap: bool = False
    topk_warps: int = 4


def blocks_for(M: int) -> LogitBlocks:
    """The logits kernel's launch for M tokens: the fastest of the H200 sweep at 32, 64 and 128 tokens
    (tools/bench/router.py, BENCHMARKS.md, eighteenth session), with the top-k kernel at 8 warps there (3-5 % faster
    than 4); 8 and 256 keep the earlier sweep's picks. Few tokens leave few (token, expert) tiles, so K is split
    further to fill the SMs."""
    if M <= 16:
        return LogitBlocks(16, 32, 128, 8)
    if M <= 32:
        return LogitBlocks(32, 64, 128, 8, stages=4, swap=True, topk_warps=8)
    if M <= 64:
        return LogitBlocks(64, 64, 128, 8, stages=4, topk_warps=8)
    if M <= 128:
        return LogitBlocks(64, 64, 128, 4, stages=4, swap=True, topk_warps=8)
    return LogitBlocks(64, 32, 64, 4 if M <= 256 else 1)


def route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int,
          renormalize: bool, scaling_factor: float, num_expert_group: int = 1, topk_group: int = 1,
          blocks: LogitBlocks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.route. x: [M, D]; gate_weight: [E, D]; correction_bias: [E] or None.
    blocks: the logits kernel's launch instead of blocks_for(M) (for tools/bench/router.py's sweep).

    Returns:
        (topk_ids int64 [M, top_k], topk_weights fp32 [M, top_k]), ids in descending biased score.
    """
    ok, why = fits(x, gate_weight, top_k, num_expert_group, topk_group)
    if not ok:
        raise ValueError(f"route (triton): {why}")
    M, D = x.shape
    E = gate_weight.shape[0]
    x = x.contiguous()
    b = blocks or blocks_for(M)
    splits = b.splits
    k_per_split = triton.cdiv(triton.cdiv(D, splits), b.bk) * b.bk
    part = torch.empty(splits, M, E, dtype=torch.float32, device=x.device)
    router_logits_kernel[(triton.cdiv(M, b.bm), triton.cdiv(E, b.be), splits)](
        x, gate_weight, part, M, E, D, x.stride(0), gate_weight.stride(0), part.stride(0), part.stride(1),
        k_per_split, BM=b.bm, BE=b.be, BK=b.bk, SWAP=b.swap, num_warps=b.warps, num_stages=b.stages, **pdl(x))
    return select_experts(part, correction_bias, top_k=top_k, renormalize=renormalize, scaling_factor=scaling_factor,
                          splits=splits, num_warps=b.topk_warps)


# Columns a cast program of the top-k launch stores, up to CAST_SPLIT_MAX_TOKENS tokens; past them one program casts
# a whole row. H200 timelines (BENCHMARKS.md, twenty-fifth session): at 32 tokens the launch took 4.0 µs with 1024
# columns a program against 4.9 with the cast inside the selecting program; at 128, 4.3 µs with a row a program
# against 6.1 with 1024 columns and 5.1 inside. The threshold lies between those sizes; 64 itself was not timed.
CAST_COLUMNS = 1024
CAST_SPLIT_MAX_TOKENS = 64
SELECT_WARPS = 8  # the top-k launch's warps when its caller names none (MoEInProj)


def select_experts(part: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int, renormalize: bool,
                   scaling_factor: float, splits: int = 1, num_warps: int | None = None,
                   cast: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k launch: fp32 logits as `splits` partials [splits, M, E] (route's logits kernel), or as a [M, E]
    view with any row stride (splits 1). cast (h, out): the same launch stores h[:, :N] into out [M, N] in out's
    dtype (MoEInProj: the rest of the GEMM's row)."""
    M, E = part.shape[-2:]
    ids = torch.empty(M, top_k, dtype=torch.int64, device=part.device)
    wts = torch.empty(M, top_k, dtype=torch.float32, device=part.device)
    if M == 0:
        return ids, wts
    bias = correction_bias.float().contiguous() if correction_bias is not None else part
    h, out = cast if cast is not None else (None, None)
    n_cast = out.shape[1] if cast is not None else 0
    if cast is None:
        bc = 1  # no cast programs (CAST is a constexpr: BC is unused)
    else:
        bc = CAST_COLUMNS if M <= CAST_SPLIT_MAX_TOKENS else triton.next_power_of_2(n_cast)
    router_topk_kernel[(M, 1 + triton.cdiv(n_cast, bc))](
        part, bias, ids, wts, E, part.stride(0) if splits > 1 else 0, part.stride(-2), float(scaling_factor),
        NUM_SPLITS=splits, TOP_K=top_k, BE=triton.next_power_of_2(E), HAS_BIAS=correction_bias is not None,
        RENORM=renormalize, h_ptr=h, out_ptr=out, N_CAST=n_cast, stride_h=h.stride(0) if cast is not None else 0,
        stride_out=out.stride(0) if cast is not None else 0, CAST=cast is not None, BC=bc,
        num_warps=num_warps or SELECT_WARPS, **pdl(part))
    return ids, wts
