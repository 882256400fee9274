"""Measurements on the build machine's GPU that decide a tactic (`k3build build --tune`).

The FP8 prefill tactic (triton_f8) trades exactness for FP8 tensor cores. The build takes it only where, on this
checkpoint's own experts, its output stays within the parity bar of the W4A16 tactic it would replace (rel-L2 <
3e-2 and cosine > 0.999, the bar every plugin is held to against its reference) and its prefill step is faster.
It runs before the layout pass, on rank 0's first MoE layer in the checkpoint's byte order, because the tactic
decides the expert layout the build writes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..config import K3Config
from ..mapping import Mapping
from .layout import engine_tensors

FP8_REL_BAR, FP8_COS_BAR = 3e-2, 0.999
MOE_LEAVES = ("w13", "w13_scale", "w2", "w2_scale")


def fp8_within_bar(rel: float, cos: float) -> bool:
    return rel < FP8_REL_BAR and cos > FP8_COS_BAR


def first_moe_layer(cfg: K3Config, mapping: Mapping, converted_dir: Path,
                    dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
    """(w13, w13_scale, w2, w2_scale) of rank 0's first MoE layer, stacked as the engine stacks them but in the
    checkpoint's byte order; None when rank 0 has no MoE layer."""
    found = {}
    with safe_open(Path(converted_dir) / "rank0.safetensors", framework="pt") as src:
        for name, t in engine_tensors(cfg, mapping, 0, src.get_tensor, dtype, expert_layout="natural"):
            _, _, leaf = name.partition(".moe.")
            if leaf in MOE_LEAVES:
                found[leaf] = t
                if len(found) == len(MOE_LEAVES):
                    return tuple(found[k] for k in MOE_LEAVES)
    return None


def fp8_trial(w13, s13, w2, s2, cfg: K3Config, base: str, *, seed: int = 0, reps: int = 10) -> dict[str, float]:
    """The FP8 prefill tactic against the W4A16 prefill tactic `base` (a key of k3plugins.moe.triton.TACTICS) on
    one layer's local experts (natural bytes, laid out here for each), for a prefill step of random tokens routed
    uniformly: rel-L2 and cosine of FP8's output against base's, and each one's median time."""
    from k3plugins.moe import triton as mt

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    E, Dl = w13.shape[0], w13.shape[2] * 2
    k = min(cfg.num_experts_per_token, E)
    tokens = max(mt.PREFILL_MIN_TOKENS, -(-128 * E // k))                     # >= 128 tokens an expert
    z = torch.randn(tokens, Dl, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.argsort(torch.rand(tokens, E, device=dev, generator=g), dim=1)[:, :k]
    w = torch.rand(tokens, k, device=dev, generator=g)
    s13, s2 = s13.to(dev), s2.to(dev)
    kw = dict(expert_start=0, act=cfg.hidden_act, beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    runs = {}
    for tactic in (base, "prefill_f8"):
        weights = (mt.lay_out(tactic, w13.to(dev)), mt.lay_out_scale(tactic, s13), mt.lay_out(tactic, w2.to(dev)),
                   mt.lay_out_scale(tactic, s2))
        zt = mt.lay_out_input(tactic, z)  # as the build's latent rows make it
        fn = lambda: mt.moe_experts(zt, ids, w, *weights, tactic=tactic, **kw)  # noqa: E731
        runs[tactic] = (fn().double().flatten(), _median_ms(fn, reps))
        del weights
    (ref, base_ms), (f8, f8_ms) = runs[base], runs["prefill_f8"]
    return {"moe_fp8_rel": ((f8 - ref).norm() / ref.norm()).item(),
            "moe_fp8_cos": (f8 @ ref / (f8.norm() * ref.norm())).item(),
            "moe_fp8_prefill_ms": f8_ms, "moe_w4a16_prefill_ms": base_ms}


def fp8_wins(trial: dict[str, float]) -> bool:
    return (fp8_within_bar(trial["moe_fp8_rel"], trial["moe_fp8_cos"])
            and trial["moe_fp8_prefill_ms"] < trial["moe_w4a16_prefill_ms"])


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
