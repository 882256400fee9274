"""x @ wᵀ for decode-sized x (M <= 64 rows) in Triton, weight-stationary: experimental, off by default.

At 32 tokens a real-size rank's dense GEMMs (KDA/MLA projections, latent MoE projections, shared experts) are
bound by their weight bytes, and cuBLAS ran them at about 0.58 of that floor (`bench_rank --profile`: 7.3 ms
against 4.2 ms), a fifth of it in split-K reduce kernels. Here each program streams BN weight rows over a K range
once and multiplies them by all the tokens (the weights are the MMA's M side, as in the MoE decode kernel);
when N alone gives too few programs the K range is split, and a second launch sums the fp32 partials in split
order (deterministic). `tools/bench_rank.py --gemms` measures it against torch on a real-size rank's shapes;
`bench_rank.py --skinny` runs the whole rank with it (embed/dense.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_M = 64


@dataclass(frozen=True)
class GemmBlocks:
    block_n: int = 32
    block_k: int = 256
    splits: int = 0  # 0: enough K splits for about 2 programs an SM
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_ps,
                       K_PER_SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    """acc [BN, BM] = W[n0:n0+BN, k range] @ X[:, k range]ᵀ; stored transposed into out [M, N] (SPLIT False) or
    into the fp32 partials [splits, M, N] (SPLIT True)."""
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    k_start = ps * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BK):
        k_ok = (k0 + rk) < k_end
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k0 + rk)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xT = tl.load(x_ptr + rm[None, :] * stride_xm + (k0 + rk)[:, None], mask=m_ok[None, :] & k_ok[:, None],
                     other=0.0)
        acc = tl.dot(w, xT, acc)
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + ps * stride_ps + rm[None, :] * N + rn[:, None], acc, mask=mask)
    else:
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_sum_kernel(part_ptr, out_ptr, M, N, stride_ps, stride_om, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out [M, N] = Σ_s part[s] in split order, cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=ok, other=0.0)
    tl.store(out_ptr + (offs // N) * stride_om + offs % N, acc.to(out_ptr.dtype.element_ty), mask=ok)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, blocks: GemmBlocks = GemmBlocks(),
                  sms: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M), weight [N, K] in x's dtype (bf16/fp16, or fp32 under the interpreter) -> [M, N]."""
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_M or weight.shape[1] != K or weight.dtype != x.dtype or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} (K-contiguous) must share K and dtype, with at most {MAX_M} rows")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if not (M and N):
        return out
    bm, bn, bk = max(16, triton.next_power_of_2(M)), blocks.block_n, blocks.block_k
    n_blocks = triton.cdiv(N, bn)
    splits = blocks.splits
    if not splits:
        if sms is None:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        splits = max(1, min(triton.cdiv(2 * sms, n_blocks), triton.cdiv(K, 4 * bk)))
    k_per_split = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    splits = triton.cdiv(K, k_per_split)                                       # no empty split
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    skinny_gemm_kernel[(n_blocks, splits)](x, weight, out, part, M, N, K, x.stride(0), weight.stride(0),
                                           out.stride(0), part.stride(0), k_per_split, BM=bm, BN=bn, BK=bk,
                                           SPLIT=splits > 1, num_warps=blocks.num_warps,
                                           num_stages=blocks.num_stages)
    if splits > 1:
        block = 1024
        split_sum_kernel[(triton.cdiv(M * N, block),)](part, out, M, N, part.stride(0), out.stride(0),
                                                       SPLITS=splits, BLOCK=block)
    return out

