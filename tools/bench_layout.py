"""The build's MXFP4 expert layout passes (k3build.build.layout.EXPERT_LAYOUTS) on K3-sized experts (JSON lines).

`k3build build` relays every routed expert's bytes for the MoE tactic it records: about 90 GB a TEP16 rank. Each
pass is timed on the same experts, side by side, against a copy of the same bytes (`clone`: the floor of a pass
that writes a new tensor) and against the paired layout's pass (the layout the lane one extends). The scales' pass
(row tiles) moves 1/16 of these bytes and is left out.

    python tools/bench_layout.py                         # 4 experts' w13 (K3 dims: 6144 x 3584 codes each), CPU
    python tools/bench_layout.py --experts 8 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from arg_types import count


def _best_s(fn, reps: int, sync) -> float:
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=count, default=4, help="experts' w13 to relay at once (K3: 56 a rank a layer)")
    ap.add_argument("--rows", type=count, default=6144, help="w13 rows (2 x the intermediate width)")
    ap.add_argument("--k", type=count, default=3584, help="codes a row (the latent width)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=count, default=3)
    args = ap.parse_args()

    from k3build.build.layout import EXPERT_LAYOUTS

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (args.experts, args.rows, args.k // 2), dtype=torch.uint8, generator=g).to(device)
    gb = w.numel() / 1e9
    print(json.dumps({"bench": "layout_env", "device": args.device, "torch": torch.__version__,
                      "cpus": os.cpu_count(), "machine": platform.machine(), "bytes": w.numel()}))
    floor_s = _best_s(lambda: w.clone(), args.reps, sync)
    paired_s = _best_s(lambda: EXPERT_LAYOUTS["paired"][0](w), args.reps, sync)
    for name, (relay, _) in EXPERT_LAYOUTS.items():
        if name == "natural":  # the checkpoint's bytes as they are: no pass
            continue
        s = paired_s if name == "paired" else _best_s(lambda relay=relay: relay(w), args.reps, sync)
        print(json.dumps({"bench": "layout", "layout": name, "s": round(s, 4), "gb_per_s": round(gb / s, 3),
                          "copy_gb_per_s": round(gb / floor_s, 3), "x_copy": round(s / floor_s, 2),
                          "x_paired": round(s / paired_s, 2)}))


if __name__ == "__main__":
    main()
