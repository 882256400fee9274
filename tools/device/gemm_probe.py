"""The rank's decode GEMMs by other routes than the engine's (device probe, JSON lines): cuBLAS through torch as the
engine calls it, the transposed product, cuBLAS against cuBLASLt, and a split-K Triton kernel that leaves fp32
partials for the consumer to sum (no reduce launch), each against the weight-bytes floor, in CUDA graphs with L2
flushed (common.time_ms). --chain: cuBLAS against a split-K kernel whose last program of a column block sums the
partials (no reduce launch), 16 layers' weights back to back in one graph, as a step runs them."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import emit, hbm_read_tbps, time_ms  # noqa: E402


@triton.jit
def _split_acc(x_ptr, w_ptr, pn, ps, M, K, K_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    """x[:, k-range of split ps] @ w[n-block pn, same range]ᵀ as [BN, BM] fp32 (the weights the MMA's M side)."""
    rn = pn * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN, BM), tl.float32)
    for i in range(0, K_SPLIT // BK):
        k = ps * K_SPLIT + i * BK
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + (k + rk)[None, :])
        xT = tl.load(x_ptr + rm[None, :] * K + (k + rk)[:, None], mask=(rm < M)[None, :], other=0.0)
        acc = tl.dot(w, xT, acc)
    return acc


@triton.jit
def split_k_kernel(x_ptr, w_ptr, part_ptr, M, N, K, K_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """part[s, :M, n-block] = x[:, k-range] @ w[n-block, k-range]ᵀ."""
    pn, ps = tl.program_id(0), tl.program_id(1)
    acc = _split_acc(x_ptr, w_ptr, pn, ps, M, K, K_SPLIT, BM, BN, BK)
    rn = pn * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    tl.store(part_ptr + (ps * M + rm[None, :]) * N + rn[:, None], acc, mask=(rm < M)[None, :])


@triton.jit
def split_k_fixup_kernel(x_ptr, w_ptr, part_ptr, count_ptr, out_ptr, M, N, K, K_SPLIT: tl.constexpr,
                         SPLITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """split_k_kernel, then the last split program of each column block to finish sums the SPLITS partials in split
    order into out [M, N] (out's dtype) and zeroes the block's count: no reduce launch."""
    pn, ps = tl.program_id(0), tl.program_id(1)
    acc = _split_acc(x_ptr, w_ptr, pn, ps, M, K, K_SPLIT, BM, BN, BK)
    rn = pn * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    at = (rm[None, :] * N + rn[:, None])
    m_ok = (rm < M)[None, :]
    tl.store(part_ptr + ps * M * N + at, acc, mask=m_ok)
    tl.debug_barrier()  # every thread's partials stored before the release that counts them
    if tl.atomic_add(count_ptr + pn, 1, sem="acq_rel") == SPLITS - 1:
        total = tl.zeros((BN, BM), tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(part_ptr + s * M * N + at, mask=m_ok, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + rm[None, :] * N + rn[:, None], total.to(out_ptr.dtype.element_ty), mask=m_ok)
        tl.atomic_xchg(count_ptr + pn, 0)


_COUNTS = {}  # per device: a count per column block (zero between launches: the last program resets its own)
COUNT_SLOTS = 4096


def split_k_fixup(x, w, splits, bn, bk, warps, stages, out_dtype):
    """x @ wᵀ in out_dtype by split_k_fixup_kernel (`splits` K ranges of bk steps, bn weight rows a program)."""
    M, K = x.shape
    N = w.shape[0]
    assert N // bn <= COUNT_SLOTS, "more column blocks than counts"
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if x.device not in _COUNTS:
        _COUNTS[x.device] = torch.zeros(COUNT_SLOTS, dtype=torch.int32, device=x.device)
    split_k_fixup_kernel[(N // bn, splits)](x, w, part, _COUNTS[x.device], out, M, N, K, K // splits, SPLITS=splits,
                                            BM=max(16, triton.next_power_of_2(M)), BN=bn, BK=bk, num_warps=warps,
                                            num_stages=stages)
    return out


def split_k(x, w, splits, bn, bk, warps, stages):
    """fp32 partials [splits, M, N] of x @ wᵀ by split_k_kernel (the consumer sums them)."""
    M, K = x.shape
    N = w.shape[0]
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    split_k_kernel[(N // bn, splits)](x, w, part, M, N, K, K // splits, BM=max(16, triton.next_power_of_2(M)), BN=bn,
                                      BK=bk, num_warps=warps, num_stages=stages)
    return part


def chained_us(fns) -> float:
    """µs a call of a CUDA graph that runs fns one after the other (each on its own weights, together past L2: as the
    step streams its layers), divided by their number."""
    return time_ms(lambda: [f() for f in fns], flush=False) * 1e3 / len(fns)


def chain(N, K, M, out_dtype, gen, layers=16):
    """The engine's GEMM against the split-K fixup kernel over `layers` distinct weights, in-graph and back to back."""
    ws = [(torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(torch.bfloat16) for _ in range(layers)]
    x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
    if out_dtype == torch.float32:
        blas = [lambda w=w: torch.mm(x, w.t(), out_dtype=torch.float32) for w in ws]
    else:
        blas = [lambda w=w: x @ w.T for w in ws]
    rec = dict(bench="gemm_chain", N=N, K=K, M=M, out=str(out_dtype)[6:], layers=layers, blas_us=chained_us(blas))
    want = x.float() @ ws[0].float().T
    for splits, bn in ((2, 64), (4, 64), (2, 128), (4, 32), (8, 64)):
        if N % bn or K % (splits * 128):
            continue
        fns = [lambda w=w: split_k_fixup(x, w, splits, bn, 128, 4, 4, out_dtype) for w in ws]
        got = fns[0]().float()
        rec[f"fixup_s{splits}_bn{bn}_us"] = chained_us(fns)
        rec[f"fixup_s{splits}_bn{bn}_rel"] = ((got - want).norm() / want.norm()).item()
    del ws
    return {k: round(v, 2) if isinstance(v, float) and k.endswith("_us") else v for k, v in rec.items()}


def main() -> None:
    bw = hbm_read_tbps()
    emit(bench="gemm_probe_env", hbm_read_tbps=round(bw, 3))
    gen = torch.Generator(device="cuda").manual_seed(0)
    if "--chain" in sys.argv:
        for N, K, dt in ((3264, 7168, torch.bfloat16), (2880, 7168, torch.bfloat16), (5248, 7168, torch.float32)):
            for M in (32, 64):
                emit(**chain(N, K, M, dt, gen), floor_us=round(N * K * 2 / (bw * 1e12) * 1e6, 2))
        return
    for N, K in ((5248, 7168), (3264, 7168), (2880, 7168), (7168, 768), (7168, 608)):
        w = (torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(torch.bfloat16)
        floor_ms = w.nbytes / (bw * 1e12) * 1e3
        for M in (32, 64):
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            want = x.float() @ w.float().T
            rec = dict(bench="gemm_probe", N=N, K=K, M=M, floor_us=round(floor_ms * 1e3, 2))
            rec["torch_us"] = time_ms(lambda: x @ w.T) * 1e3
            rec["torch_f32out_us"] = time_ms(lambda: torch.mm(x, w.t(), out_dtype=torch.float32)) * 1e3
            rec["transposed_us"] = time_ms(lambda: w @ x.T) * 1e3
            for lib in ("cublas", "cublaslt"):
                old = torch.backends.cuda.preferred_blas_library()
                torch.backends.cuda.preferred_blas_library(lib)
                rec[f"{lib}_us"] = time_ms(lambda: x @ w.T) * 1e3
                torch.backends.cuda.preferred_blas_library(old)
            best = None
            for splits in (2, 4):
                for bn, bk, warps, stages in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4)):
                    if N % bn or K % (splits * bk) or (K // splits) // bk < 2:
                        continue
                    fn = lambda: split_k(x, w, splits, bn, bk, warps, stages)  # noqa: E731
                    err = ((fn().sum(0) - want).norm() / want.norm()).item()
                    t = time_ms(fn) * 1e3
                    if best is None or t < best[0]:
                        best = (t, dict(splits=splits, bn=bn, bk=bk, warps=warps, stages=stages), err)
            if best:
                rec["triton_splitk_us"], rec["triton_cfg"], rec["triton_rel"] = best[0], best[1], best[2]
                rec["triton_of_floor"] = round(rec["floor_us"] / best[0], 3)
            rec = {k: round(v, 2) if isinstance(v, float) and k.endswith("_us") else v for k, v in rec.items()}
            rec["torch_of_floor"] = round(rec["floor_us"] / rec["torch_us"], 3)
            emit(**rec)


if __name__ == "__main__":
    main()
