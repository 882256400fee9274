"""Measurements on the build machine's GPU that decide a tactic (`k3build build --tune`).

The FP8 prefill tactic (triton_f8) trades exactness for FP8 tensor cores. The build takes it only where its output
on this checkpoint's own experts stays within the parity bar of the W4A16 tactic it replaces (triton_s, the same
expert layout): rel-L2 < 3e-2 and cosine > 0.999, the bar every plugin is held to against its reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..config import K3Config

FP8_REL_BAR, FP8_COS_BAR = 3e-2, 0.999


def fp8_within_bar(rel: float, cos: float) -> bool:
    return rel < FP8_REL_BAR and cos > FP8_COS_BAR


def fp8_drift(w13, s13, w2, s2, cfg: K3Config, *, tokens: int = 1024, seed: int = 0) -> tuple[float, float]:
    """(rel-L2, cosine) of the FP8 prefill tactic against W4A16 (`prefill_s`) on one layer's local experts (the
    strided bytes the build wrote), for `tokens` random tokens routed uniformly over them."""
    from k3plugins.moe import triton as mt

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    E, Dl = w13.shape[0], w13.shape[2] * 2
    k = min(cfg.num_experts_per_token, E)
    z = torch.randn(tokens, Dl, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.argsort(torch.rand(tokens, E, device=dev, generator=g), dim=1)[:, :k]
    w = torch.rand(tokens, k, device=dev, generator=g)
    weights = [t.to(dev) for t in (w13, s13, w2, s2)]
    kw = dict(expert_start=0, act=cfg.hidden_act, beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    ref = mt.moe_experts(z, ids, w, *weights, tactic="prefill_s", **kw).double().flatten()
    f8 = mt.moe_experts(z, ids, w, *weights, tactic="prefill_f8", **kw).double().flatten()
    return ((f8 - ref).norm() / ref.norm()).item(), (f8 @ ref / (f8.norm() * ref.norm())).item()


def first_moe_layer(rank_weights: Path) -> tuple[torch.Tensor, ...] | None:
    """(w13, w13_scale, w2, w2_scale) of the first MoE layer in a built rank file, or None without one."""
    with safe_open(rank_weights, framework="pt") as f:
        names = [n for n in f.keys() if n.endswith(".moe.w13")]
        if not names:
            return None
        p = min(names, key=lambda n: int(n.split(".")[0][1:]))[:-3]
        return tuple(f.get_tensor(p + leaf) for leaf in ("w13", "w13_scale", "w2", "w2_scale"))
