"""Would FP8 scores pass the parity bar? Absorbed-MLA decode with Q·K^T in e4m3 (the one way left to make the
96-head decode memory-bound on an H200: half the scores' MMA time), against the fp64 definition, beside bf16.

    python tools/mla_fp8_drift.py [--heads 96] [--tokens 8192] [--seeds 3]

CPU only (torch's float8_e4m3fn rounds exactly as the MMA's operands would be; products of e4m3 values are exact
in the fp32 accumulator). The emulated kernel: queries in e4m3 with a scale a head (amax / 448, the scale folded
into the softmax), the cached keys (latent and rope) in e4m3 unscaled (unit-scale rows, as the latent RMSNorm
gives), the values and P·V in bf16 as now. Prints one JSON line a query scale: rel-L2 and cosine of the output
against fp64, for FP8 and bf16 scores, and whether FP8 is within DESIGN.md's bar (cosine > 0.999, rel-L2 < 3e-2).
"""

from __future__ import annotations

import argparse
import json

import torch

from arg_types import count

BAR_COS, BAR_REL = 0.999, 3e-2
E4M3_MAX = 448.0


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·k^T · scale)·v in fp64 on the values given (already rounded as the kernel would)."""
    return torch.softmax((q.double() @ k.double().T) * scale, -1) @ v.double()


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()


def drift(out: torch.Tensor, ref: torch.Tensor) -> dict:
    rel = ((out - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0).item()
    return {"rel_l2": rel, "cos": cos}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=count, default=96)
    ap.add_argument("--tokens", type=count, default=8192)
    ap.add_argument("--seeds", type=count, default=3)
    ap.add_argument("--latent", type=count, default=512)
    ap.add_argument("--rope", type=count, default=64)
    args = ap.parse_args()
    scale = (128 + args.rope) ** -0.5  # K3's qk head dim (nope 128 + rope 64)
    for q_std in (0.5, 1.0, 2.0, 4.0):  # query rows' scale against unit-scale keys: flatter to sharper attention
        worst = {"fp8": {"rel_l2": 0.0, "cos": 1.0}, "bf16": {"rel_l2": 0.0, "cos": 1.0}}
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            q = torch.randn(args.heads, args.latent + args.rope, generator=g) * q_std
            k = torch.randn(args.tokens, args.latent + args.rope, generator=g)
            v = k[:, :args.latent]
            ref = attention(q, k, v, scale)
            q_scale = q.abs().amax(1, keepdim=True) / E4M3_MAX
            fp8 = attention(to_e4m3(q / q_scale) * q_scale, to_e4m3(k), v.bfloat16(), scale)
            bf16 = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale)
            for name, out in (("fp8", fp8), ("bf16", bf16)):
                d = drift(out, ref)
                worst[name] = {"rel_l2": max(worst[name]["rel_l2"], d["rel_l2"]),
                               "cos": min(worst[name]["cos"], d["cos"])}
        fp8_ok = worst["fp8"]["cos"] > BAR_COS and worst["fp8"]["rel_l2"] < BAR_REL
        print(json.dumps({"bench": "mla_fp8_drift", "heads": args.heads, "tokens": args.tokens, "q_std": q_std,
                          "seeds": args.seeds, "fp8_scores": worst["fp8"], "bf16_scores": worst["bf16"],
                          "fp8_within_bar": fp8_ok}), flush=True)


if __name__ == "__main__":
    main()
