"""Where the lane MoE decode's fixed cost goes (device probe, JSON lines): `touched` experts with `tpe` tokens each
on the rank's grid of 56, each launch's start and end (µs from the call's first kernel) inside CUDA-graph replays,
medians over replays; beside it the whole call's graph time and the floor of the touched experts' bytes. Variants
(--variants, default all): decode_l; decode_l_gc (the gathering combine); decode_l with the sort's flat scan
(decode_l:1, SORT_COLS 1). batch127 ran decode_l_ac here too (the combine awaiting each token's experts beside the
down kernel; removed after, BENCHMARKS.md)."""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import torch  # noqa: E402
from common import _flush_l2, emit, hbm_read_tbps, time_ms  # noqa: E402
from k3plugins.moe import triton as mt  # noqa: E402
from moe import E_START, laid_out_experts, make_tokens  # noqa: E402


def graph_timeline(fn, replays: int = 15) -> list:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    calls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            _flush_l2()
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    ev = [e for e in ev if "elementwise" not in e.name and "fill" not in e.name.lower()]  # the L2 flush
    n = len(ev) // replays
    for r in range(replays):
        one = ev[r * n:(r + 1) * n]
        t0 = one[0].time_range.start
        calls.append([(e.name[:20], e.time_range.start - t0, e.time_range.end - t0) for e in one])
    names = [c[0] for c in calls[0]]
    return [[names[i], round(statistics.median(c[i][1] for c in calls), 1),
             round(statistics.median(c[i][2] for c in calls), 1)] for i in range(len(names))]


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", default="decode_l,decode_l_gc,decode_l:1",
                    help="tactics, each with :COLS for the sort's tile width (default SORT_COLS)")
    args = ap.parse_args()
    bw = hbm_read_tbps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    laid, one_expert = laid_out_experts(gen, mt.TACTICS["decode_l"])  # decode_l_gc reads the same layout
    emit(bench="moe_fixed_env", hbm_read_tbps=round(bw, 3))
    cols = mt.SORT_COLS
    try:
        # bench_plugins' 8 tokens an expert first: the case these variants are for
        for touched, tpe in ((56, 8), (0, 1), (8, 1), (24, 1), (56, 1), (24, 2)):
            z, ids, tw = make_tokens(tpe, gen, touched=max(touched, 1))
            if touched == 0:  # one token, no local expert
                ids = ids.clone()
                ids[:, 0] = 0
            for variant in args.variants.split(","):
                tactic, _, sort_cols = variant.partition(":")
                sort_cols = int(sort_cols or cols)
                mt.SORT_COLS = sort_cols  # read by sort_pairs at each call
                t = mt.TACTICS[tactic]
                zt = mt.lay_out_input(t, z)
                fn = lambda: mt.moe_experts(zt, ids, tw, *laid, expert_start=E_START, act="situ", tactic=t)
                ms = time_ms(fn)
                floor = touched * one_expert / (bw * 1e12) * 1e3
                emit(bench="moe_fixed", tactic=tactic, sort_cols=sort_cols, touched=touched, tpe=tpe,
                     ms=round(ms, 4), floor_ms=round(floor, 4), of_floor=round(floor / ms, 3),
                     timeline=graph_timeline(fn))
    finally:
        mt.SORT_COLS = cols


if __name__ == "__main__":
    main()
