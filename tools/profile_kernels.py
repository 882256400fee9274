"""Launch the decode kernels that hold the rank (MoE gate/up and down, the fused KDA decode; the MLA decode on
request) a few times each, on the bench shapes, for a profiler to attach to (Nsight Compute, where the machine's
runtime lets it read counters):

    python tools/profile_kernels.py                       # once without a profiler: fills Triton's cache
    ncu --clock-control none -k regex:'moe_gate_up|moe_down|kda_decode_fused' --launch-count 3 \
        --section WarpStateStats --section SourceCounters ... -o decode python tools/profile_kernels.py

Each target runs `--calls` times (default 1); tools/device/batch26.sh is a whole run, with the report's pages
written out as CSV for tools/ncu_summary.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

import torch  # noqa: E402


def moe_target(tokens_per_expert: int):
    import moe
    from k3plugins.moe import triton as mt
    gen = torch.Generator(device="cuda").manual_seed(0)
    (a, sa, b, sb), _ = moe.laid_out_experts(gen, mt.TACTICS["decode_p"])
    z, ids, tw = moe.make_tokens(tokens_per_expert, gen)
    return lambda: mt.moe_experts(z, ids, tw, a, sa, b, sb, expert_start=moe.E_START, act="situ", tactic="decode_p")


def kda_target(sequences: int):
    import kda
    from k3plugins.kda import fla as kda_dev
    args = kda._inputs(sequences, torch.Generator(device="cuda").manual_seed(2))
    return lambda: kda_dev.kda_decode(*args, num_heads=kda.H, head_dim=kda.K, lower_bound=-5.0, eps=1e-5,
                                      tactic="fused")


def mla_target(heads: int, exchange: bool, kernel: str = "triton"):
    import mla
    from k3plugins.mla.triton import mla_decode_attention
    kv, pt, lens, ql, qp = mla.make_case(64, 8192, heads, torch.Generator(device="cuda").manual_seed(1))
    return lambda: mla_decode_attention(ql, qp, kv, pt, lens, scale=mla.SCALE, exchange=exchange, kernel=kernel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-tokens", type=int, default=1, help="tokens per expert of the MoE target (0: skip it)")
    ap.add_argument("--kda-sequences", type=int, default=64, help="sequences of the KDA target at 96 heads (0: skip)")
    ap.add_argument("--mla-heads", type=int, default=0, help="heads of the MLA target at 64 x 8K (0: skip it); "
                    "it runs with the scores' exchange off, then on")
    ap.add_argument("--mla-kernel", choices=("triton", "gluon"), default="triton",
                    help="gluon: the sm_90 kernel (once; the exchange does not apply)")
    ap.add_argument("--calls", type=int, default=1)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernels: needs a CUDA GPU")
    targets = []
    if args.moe_tokens:
        targets.append((f"moe decode_p, {args.moe_tokens} tokens/expert", moe_target(args.moe_tokens)))
    if args.kda_sequences:
        targets.append((f"kda fused decode, {args.kda_sequences} x 96 heads", kda_target(args.kda_sequences)))
    if args.mla_heads:
        for exchange in (False, True) if args.mla_kernel == "triton" else (False,):
            targets.append((f"mla decode ({args.mla_kernel}), 64 x 8K x {args.mla_heads} heads, exchange {exchange}",
                            mla_target(args.mla_heads, exchange, args.mla_kernel)))
    for name, fn in targets:
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        print(f"profile_kernels: {name}: {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
