"""MoEOutProj (a TEP16 rank's latent MoE way out) against the launches it replaced, and the weight-bytes floor."""

from __future__ import annotations

import torch

from common import emit, rel_l2, time_ms
from k3plugins.embed.dense import dense
from k3plugins.mlp.triton import glu
from k3plugins.moe_out.triton import moe_out_proj
from k3plugins.norm.triton import rms_norm

D, DL, TP, SHARED = 7168, 3584, 16, 6144  # hidden, latent, TP ranks, shared expert width (K3)


def bench_moe_out(bw_tbps: float, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(4)
    size, inter = DL // TP, SHARED // TP
    start = 3 * size                                                               # rank 3's latent columns
    nw = (1 + 0.1 * torch.randn(DL, device="cuda", generator=gen)).to(torch.bfloat16)
    up = (torch.randn(D, size, device="cuda", generator=gen) * size ** -0.5).to(torch.bfloat16)
    down = (torch.randn(D, inter, device="cuda", generator=gen) * inter ** -0.5).to(torch.bfloat16)
    w = torch.cat([up, down], 1)
    floor_ms = w.nbytes / (bw_tbps * 1e12) * 1e3
    kw = dict(start=start, size=size, eps=1e-5, act="situ", beta=4.0, linear_beta=25.0)
    for T in (32, 64, 128):
        y = torch.randn(T, DL, device="cuda", generator=gen) * 3
        h = (torch.randn(T, 2 * inter, device="cuda", generator=gen) * 4).to(torch.bfloat16)

        def two_gemms():  # the graph before MoEOutProj: cast, latent norm, slice, up GEMM, GLU, down GEMM, add
            z = rms_norm(y.to(torch.bfloat16), nw, eps=kw["eps"])[:, start:start + size]
            return dense(z, up) + dense(glu(h, act=kw["act"], beta=kw["beta"], linear_beta=kw["linear_beta"]), down)

        one = lambda: moe_out_proj(y, nw, h, w, **kw)                              # noqa: E731
        t_one, t_two = time_ms(one), time_ms(two_gemms)
        emit(bench="moe_out_proj", T=T, D=D, K=size + inter, floor_ms=round(floor_ms, 4), ms=round(t_one, 4),
             two_gemm_ms=round(t_two, 4), speedup_vs_two_gemms=round(t_two / t_one, 2),
             frac_of_floor=round(floor_ms / t_one, 3), rel_l2_vs_two_gemms=rel_l2(one(), two_gemms()))
