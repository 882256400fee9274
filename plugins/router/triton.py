"""Fused router in Triton, same signature and semantics as `reference.route` (groups must be trivial).

Two launches: fp32 logits x·Wᵀ from bf16 operands (tensor cores, fp32 accumulation), split over experts and
K so a decode batch still spreads over the GPU, written as per-split partials; then per token the partials
summed in a fixed order (deterministic), sigmoid, bias for selection, top-k by repeated argmax, weights
from the unbiased scores, renormalised and scaled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, part_ptr, M, E, D, stride_xm, stride_we, stride_ps, stride_pm,
                         K_PER_SPLIT, BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    pm = tl.program_id(0)
    pe = tl.program_id(1)
    ps = tl.program_id(2)
    offs_m = pm * BM + tl.arange(0, BM)
    offs_e = pe * BE + tl.arange(0, BE)
    rk = tl.arange(0, BK)
    m_mask = offs_m < M
    e_mask = offs_e < E
    acc = tl.zeros((BM, BE), dtype=tl.float32)
    k_start = ps * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BK):
        k_mask = (k0 + rk) < D
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_e[None, :] * stride_we + (k0 + rk)[:, None], mask=e_mask[None, :] & k_mask[:, None],
                    other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(part_ptr + ps * stride_ps + offs_m[:, None] * stride_pm + offs_e[None, :], acc,
             mask=m_mask[:, None] & e_mask[None, :])


@triton.jit
def router_topk_kernel(part_ptr, bias_ptr, ids_ptr, wts_ptr, E, stride_ps, stride_pm, scaling, NUM_SPLITS: tl.constexpr,
                       TOP_K: tl.constexpr, BE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    m = tl.program_id(0)
    offs_e = tl.arange(0, BE)
    e_mask = offs_e < E
    logits = tl.zeros((BE,), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        logits += tl.load(part_ptr + s * stride_ps + m * stride_pm + offs_e, mask=e_mask, other=0.0)
    scores = tl.sigmoid(logits)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0)
    choice = tl.where(e_mask, choice, float("-inf"))
    rk = tl.arange(0, TOP_K)
    ids = tl.zeros((TOP_K,), dtype=tl.int64)
    wts = tl.zeros((TOP_K,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, 0)
        # lowest index among ties, as a stable sort would pick
        idx = tl.min(tl.where(choice == best, offs_e, BE), 0)
        ids = tl.where(rk == j, idx.to(tl.int64), ids)
        wts = tl.where(rk == j, tl.sum(tl.where(offs_e == idx, scores, 0.0), 0), wts)
        choice = tl.where(offs_e == idx, float("-inf"), choice)
    if RENORM:
        wts = wts / (tl.sum(wts, 0) + 1e-20)
    tl.store(ids_ptr + m * TOP_K + rk, ids)
    tl.store(wts_ptr + m * TOP_K + rk, wts * scaling)


def supports(x: torch.Tensor, gate_weight: torch.Tensor, *, top_k: int, num_expert_group: int = 1,
             topk_group: int = 1) -> tuple[bool, str]:
    if num_expert_group != 1 or topk_group != 1:
        return False, "the Triton router implements trivial groups only (K3: 1/1)"
    if not x.is_cuda:
        return False, "the Triton router needs CUDA tensors"
    if top_k & (top_k - 1) or top_k > gate_weight.shape[0]:
        return False, f"top_k={top_k} must be a power of two <= {gate_weight.shape[0]}"
    if x.dtype not in (torch.bfloat16, torch.float16) or gate_weight.dtype != x.dtype:
        return False, "x and gate_weight must share a bf16/fp16 dtype (fp32 logits come from the accumulator)"
    return True, ""


def route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int,
          renormalize: bool, scaling_factor: float, num_expert_group: int = 1,
          topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.route. x: [M, D]; gate_weight: [E, D]; correction_bias: [E] or None.

    Returns:
        (topk_ids int64 [M, top_k], topk_weights fp32 [M, top_k]), ids in descending biased score.
    """
    ok, why = supports(x, gate_weight, top_k=top_k, num_expert_group=num_expert_group, topk_group=topk_group)
    if not ok:
        raise ValueError(f"route (triton): {why}")
    M, D = x.shape
    E = gate_weight.shape[0]
    x = x.contiguous()
    BM, BE, BK = 16 if M <= 16 else 64, 32, 64
    splits = 4 if M <= 256 else 1
    k_per_split = triton.cdiv(triton.cdiv(D, splits), BK) * BK
    part = torch.empty(splits, M, E, dtype=torch.float32, device=x.device)
    router_logits_kernel[(triton.cdiv(M, BM), triton.cdiv(E, BE), splits)](
        x, gate_weight, part, M, E, D, x.stride(0), gate_weight.stride(0), part.stride(0), part.stride(1),
        k_per_split, BM=BM, BE=BE, BK=BK, num_warps=4, num_stages=3)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=x.device)
    wts = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    bias = correction_bias.float().contiguous() if correction_bias is not None else part
    router_topk_kernel[(M,)](part, bias, ids, wts, E, part.stride(0), part.stride(1), float(scaling_factor),
                             NUM_SPLITS=splits, TOP_K=top_k, BE=triton.next_power_of_2(E),
                             HAS_BIAS=correction_bias is not None, RENORM=renormalize, num_warps=4)
    return ids, wts
