"""Router: fused Triton (fp32 logits, sigmoid, biased top-16, renorm) vs the torch reference and the W-bytes floor."""

from __future__ import annotations

import torch

from common import emit, time_ms
from k3plugins.router.reference import route as route_ref
from k3plugins.router.triton import LogitBlocks, blocks_for, route

E, D, TOP_K = 896, 7168, 16


def bench_router(bw_tbps: float, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(E, D, device="cuda", generator=gen) * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda", generator=gen) * 0.1
    for M in (8, 32, 64, 128, 256, 2048):
        x = torch.randn(M, D, device="cuda", generator=gen).to(torch.bfloat16)
        floor_ms = (w.numel() * 2 + x.numel() * 2) / (bw_tbps * 1e12) * 1e3
        kw = dict(top_k=TOP_K, renormalize=True, scaling_factor=1.0)
        ids, _ = route(x, w, bias, **kw)
        ids_r, _ = route_ref(x, w, bias, **kw)
        t = time_ms(lambda: route(x, w, bias, **kw))
        t_ref = time_ms(lambda: route_ref(x, w, bias, **kw))
        emit(bench="router", M=M, E=E, D=D, floor_ms=round(floor_ms, 4), triton_ms=round(t, 4),
             torch_ref_ms=round(t_ref, 4), speedup_vs_torch=round(t_ref / t, 2), frac_of_floor=round(floor_ms / t, 3),
             rows_matching_ref=round((ids == ids_r).all(1).float().mean().item(), 4))
        if sweep and 32 <= M <= 128:  # the rank's decode batches (bench_rank.py)
            _sweep(M, x, w, bias, kw, floor_ms, t)


def _sweep_blocks(M: int):
    """The logits kernel's launches tried at M tokens: both MMA orientations, tiles up to the whole batch, K splits
    that fill the SMs without making the partials (splits × M × E fp32) large."""
    bm_all = sorted({min(M, 128), min(M, 64)})
    for swap in (False, True):
        for bm in bm_all:
            for be in (32, 64, 128):
                for bk in (64, 128):
                    for splits in (2, 4, 8, 16):
                        for warps, stages in ((4, 3), (4, 4)):
                            b = LogitBlocks(bm, be, bk, splits, warps, stages, swap)
                            smem = (bm + be) * bk * 2 * stages
                            ctas = -(-M // bm) * -(-896 // be) * splits
                            if smem <= 160 * 1024 and 96 <= ctas <= 900 and (be >= 64 or not swap):
                                yield b


def _sweep(M, x, w, bias, kw, floor_ms, t_default) -> None:
    best = (t_default, blocks_for(M))
    for b in _sweep_blocks(M):
        try:
            t_b = time_ms(lambda: route(x, w, bias, **kw, blocks=b))
        except Exception as exc:  # a launch the GPU cannot take (shared memory, registers): skipped, said so
            emit(bench="router_config", M=M, blocks=b._asdict(), error=type(exc).__name__)
            continue
        emit(bench="router_config", M=M, **b._asdict(), ms=round(t_b, 4), frac_of_floor=round(floor_ms / t_b, 3))
        best = min(best, (t_b, b))
    emit(bench="router_best", M=M, default_ms=round(t_default, 4), best_ms=round(best[0], 4), **best[1]._asdict(),
         speedup_vs_default=round(t_default / best[0], 3))
    for warps in (2, 4, 8, 16):  # the top-k kernel's, with the logits kernel's default launch
        b = blocks_for(M)._replace(topk_warps=warps)
        t_b = time_ms(lambda: route(x, w, bias, **kw, blocks=b))
        emit(bench="router_topk_warps", M=M, topk_warps=warps, ms=round(t_b, 4),
             frac_of_floor=round(floor_ms / t_b, 3))
