"""MoE decode as a rank sees it: one token on each of the first `touched` of its 56 experts, the rest empty.

The rank's step touches about 24 of 56 experts at 32 requests (uniform top-16 of 896), so its MoE grid (56 experts
x row blocks, fixed: no host sync) runs about 1150 live programs instead of bench_moe's 2700. This sweep shows the
time against the touched experts' bytes as that count varies: a fixed cost of about 23 µs a call (the grid's
ramp and drain, twice: gate/up, then down) beside 5.6 µs an expert (nineteenth session). The variants: the grid
rows first, the down kernel overlapping the gate/up kernel's drain (MoETactic.overlap), and the L2 prefetch while
the sort runs (MoETactic.prefetch), which also fetches the untouched experts' first weights.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from common import emit, rel_l2, time_ms
from k3plugins.moe import triton as mt
from k3plugins.moe.reference import moe_experts as moe_ref
from moe import E_START, expert_bytes, make_tokens, make_weights

_D = mt.TACTICS["decode_p"]
VARIANTS = {  # name -> tactic (BM 16, BK 256, paired and tiled layout as decode_p; decode_l on lane_mxfp4's)
    "decode_p": _D,
    "decode_l": mt.TACTICS["decode_l"],
    # decode_l asking L2 for 4 K steps of each program's weights during the sort: untouched experts' too
    "decode_l_pf4": replace(mt.TACTICS["decode_l"], prefetch=4),
    # 2 K steps in the grid's first 2 programs an SM only (MoETactic.prefetch_per_sm): the engine's decode_l_pf
    "decode_l_pf2_w2": mt.TACTICS["decode_l_pf"],
    "plain": replace(_D, rows_first=False, overlap=False),
    "rows_first": replace(_D, rows_first=True, overlap=False),
    "overlap_experts_first": replace(_D, rows_first=False, overlap=True),
}


def bench_moe_touched(bw_tbps: float, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = make_weights(gen)
    one_expert = expert_bytes(w13, s13, w2, s2)
    laid = {lane: mt.lay_out_experts(t, w13, s13, w2, s2)
            for lane, t in ((False, _D), (True, mt.TACTICS["decode_l"]))}
    z, ids, tw = make_tokens(1, gen, touched=7)
    ref = moe_ref(z, ids, tw, w13, s13, w2, s2, expert_start=E_START, act="situ")
    for name, t in VARIANTS.items():
        out = mt.moe_experts(mt.lay_out_input(t, z), ids, tw, *laid[t.lane], expert_start=E_START, act="situ", tactic=t)
        emit(bench="moe_touched_check", variant=name, rel_l2=rel_l2(out, ref))
    for touched in (8, 16, 20, 22, 24, 26, 28, 32, 40, 48, 56):
        z, ids, tw = make_tokens(1, gen, touched=touched)
        floor_ms = touched * one_expert / (bw_tbps * 1e12) * 1e3
        rec = dict(bench="moe_touched", touched=touched, floor_ms=round(floor_ms, 4))
        for name, t in VARIANTS.items():
            zt = mt.lay_out_input(t, z)
            ms = time_ms(lambda t=t, zt=zt: mt.moe_experts(zt, ids, tw, *laid[t.lane], expert_start=E_START,
                                                           act="situ", tactic=t))
            rec[name] = round(floor_ms / ms, 3)
            rec[name + "_ms"] = round(ms, 4)
        emit(**rec)
