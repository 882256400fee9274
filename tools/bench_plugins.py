"""Plugin benchmarks on one GPU: JSON lines, every figure a ratio to a floor or baseline measured in this run.

    python tools/bench_plugins.py [--only SECTION,...] [--sweep]
    sections: moe, mla, kda, router, kda_prefill, kda_drift, attn_res, moe_out, moe_touched (tools/bench/SECTION.py)

Floors use the HBM read bandwidth measured first (sum of an 8 GiB bf16 tensor, ANCHORS.md). Times are
medians of CUDA-event-timed CUDA-graph replays with the L2 flushed before each.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

import torch  # noqa: E402

from common import emit, hbm_read_tbps  # noqa: E402

SECTIONS = ("moe", "mla", "kda", "router", "kda_prefill", "kda_drift", "attn_res", "moe_out", "moe_touched")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--sweep", action="store_true", help="also time the block-config sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_plugins: needs a CUDA GPU")
    import triton
    bw = hbm_read_tbps()
    emit(bench="env", device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
         hbm_read_tbps=round(bw, 3))
    for name in args.only.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"bench_plugins: unknown section {name!r}; choose from {SECTIONS}")
        mod = __import__(name)
        getattr(mod, f"bench_{name}")(bw, args.sweep)


if __name__ == "__main__":
    main()
