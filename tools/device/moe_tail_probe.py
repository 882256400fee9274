"""Where the MoE decode's fixed cost goes (device probe, JSON lines): one token on each of `touched` experts, timed
(a) on the rank's grid of 56 experts with the touched ones first (bench moe_touched), (b) with them spread over the
56 as a rank's routing spreads them, (c) on a grid of the touched experts only (no empty programs); and the kernel
timeline of one call (start and length of each launch, µs from the first) for (a)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import torch  # noqa: E402
from dataclasses import replace  # noqa: E402
from common import cuda_events, emit, hbm_read_tbps, time_ms  # noqa: E402
from k3plugins.moe import triton as mt  # noqa: E402
from moe import E, E_START, laid_out_experts, make_tokens  # noqa: E402


def timeline(fn) -> list:
    ev = cuda_events(fn)
    t0 = ev[0].time_range.start
    return [[e.name[:24], round(e.time_range.start - t0, 1), round(e.time_range.end - e.time_range.start, 1)]
            for e in ev]


def main() -> None:
    bw = hbm_read_tbps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = mt.TACTICS["decode_p"]
    laid, one_expert = laid_out_experts(gen, t)
    for touched in (8, 24, 56):
        z, ids, tw = make_tokens(1, gen, touched=touched)
        spread = torch.randperm(E, generator=torch.Generator().manual_seed(touched))[:touched].to("cuda") + E_START
        ids_spread = torch.cat([spread[:, None], ids[:, 1:]], 1)
        compact = tuple(x[:touched] for x in laid)
        run = {
            "first": lambda: mt.moe_experts(z, ids, tw, *laid, expert_start=E_START, act="situ", tactic="decode_p"),
            "spread": lambda: mt.moe_experts(z, ids_spread, tw, *laid, expert_start=E_START, act="situ",
                                             tactic="decode_p"),
            "compact": lambda: mt.moe_experts(z, ids, tw, *compact, expert_start=E_START, act="situ",
                                              tactic="decode_p"),
        }
        floor = touched * one_expert / (bw * 1e12) * 1e3
        rec = dict(bench="moe_tail", touched=touched, floor_ms=round(floor, 4))
        for name, fn in run.items():
            rec[name + "_ms"] = round(time_ms(fn), 4)
        emit(**rec)
        emit(bench="moe_tail_timeline", touched=touched, kernels=timeline(run["first"]))
        emit(bench="moe_tail_timeline_plain", touched=touched,
             kernels=timeline(lambda: mt.moe_experts(z, ids, tw, *laid, expert_start=E_START, act="situ",
                                                      tactic=replace(t, overlap=False))))


if __name__ == "__main__":
    main()
