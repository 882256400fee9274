"""Router: fused Triton (fp32 logits, sigmoid, biased top-16, renorm) vs the torch reference and the W-bytes floor."""

from __future__ import annotations

import torch

from common import emit, time_ms
from k3plugins.router.reference import route as route_ref
from k3plugins.router.triton import route

E, D, TOP_K = 896, 7168, 16


def bench_router(bw_tbps: float, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(E, D, device="cuda", generator=gen) * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda", generator=gen) * 0.1
    for M in (8, 64, 256, 2048):
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
        if sweep and M <= 256:  # the logits kernel's blocks: more programs for small M, fewer partials to sum
            for blocks in ((16, 32, 64, 4), (16, 16, 128, 8), (16, 32, 128, 8), (16, 16, 64, 16), (32, 32, 64, 8),
                           (64, 32, 64, 4), (16, 64, 64, 8)):
                t_b = time_ms(lambda: route(x, w, bias, **kw, blocks=blocks))
                emit(bench="router_config", M=M, BM=blocks[0], BE=blocks[1], BK=blocks[2], splits=blocks[3],
                     ms=round(t_b, 4), frac_of_floor=round(floor_ms / t_b, 3))
