"""Probe (twenty-first session): should the router's logits come out of the MoE in_proj GEMM?

Both read the same normed hidden x. Today: cuBLAS in_proj (4352 x 7168, bf16 out) and the Triton route (logits
kernel over 896 x 7168, then top-k), one after the other below 64 tokens and forked onto a side stream from 64 on.
Merged: one cuBLAS GEMM over the stacked weights (5248 x 7168) with fp32 output (torch.mm's out_dtype), the
existing top-k kernel reading the logit columns, and a cast of the in_proj columns to bf16 (a torch launch here;
the engine would fold it into the top-k kernel: `nocast` bounds that). Eight layers' distinct weights a replay,
variants captured once and replayed in turn over five rounds. JSON lines on stdout.
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from k3plugins.router import triton as rt

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from common import hbm_read_tbps, interleaved_replays_us  # noqa: E402

N_IN, E, D, TOP_K, LAYERS = 4352, 896, 7168, 16, 8


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = hbm_read_tbps()
    side = torch.cuda.Stream()
    for M in [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "32,64,128").split(",")]:
        x = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
        w_in = [torch.randn(N_IN, D, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        gate = [torch.randn(E, D, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        bias = [torch.randn(E, device=dev) * 0.01 for _ in range(LAYERS)]
        merged = [torch.cat([a, g]) for a, g in zip(w_in, gate)]
        kw = dict(top_k=TOP_K, renormalize=True, scaling_factor=1.0)

        def serial():
            for i in range(LAYERS):
                F.linear(x, w_in[i])
                rt.route(x, gate[i], bias[i], **kw)

        def forked():
            main_s = torch.cuda.current_stream()
            for i in range(LAYERS):
                side.wait_stream(main_s)
                with torch.cuda.stream(side):
                    rt.route(x, gate[i], bias[i], **kw)
                F.linear(x, w_in[i])
                main_s.wait_stream(side)

        def merged_run(cast=True):
            for i in range(LAYERS):
                out = torch.mm(x, merged[i].t(), torch.float32)
                rt.select_experts(out[:, N_IN:], bias[i], **kw)
                if cast:
                    out[:, :N_IN].to(torch.bfloat16)

        variants = {
            "serial": serial, "forked": forked, "merged": merged_run, "merged_nocast": lambda: merged_run(False),
            "gemm_in_bf16": lambda: [F.linear(x, w) for w in w_in],
            "gemm_merged_bf16": lambda: [F.linear(x, w) for w in merged],
            "gemm_merged_f32": lambda: [torch.mm(x, w.t(), torch.float32) for w in merged],
            "route_only": lambda: [rt.route(x, g, b, **kw) for g, b in zip(gate, bias)],
        }
        # the merged route picks what route() picks (both fp32 accumulations of the same bf16 products)
        ids_a, wts_a = rt.route(x, gate[0], bias[0], **kw)
        out = torch.mm(x, merged[0].t(), torch.float32)
        ids_b, wts_b = rt.select_experts(out[:, N_IN:], bias[0], **kw)
        same_rows = (ids_a.sort(1).values == ids_b.sort(1).values).all(1).float().mean().item()
        in_match = (out[:, :N_IN].to(torch.bfloat16) == F.linear(x, w_in[0])).float().mean().item()
        graphs = {}
        for name, fn in variants.items():
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            graphs[name] = g
        times = interleaved_replays_us({n: g.replay for n, g in graphs.items()})
        floor_us = (N_IN + E) * D * 2 / (bw * 1e12) * 1e6
        rec = {n: round(t / LAYERS, 2) for n, t in times.items()}
        print(json.dumps({"probe": "router_merge", "M": M, "hbm_tbps": round(bw, 3), "floor_us_a_layer":
                          round(floor_us, 2), "us_a_layer": rec, "same_expert_rows": same_rows,
                          "in_proj_bits_equal": round(in_match, 4),
                          "weights_max_diff": (wts_a.sort(1).values - wts_b.sort(1).values).abs().max().item()}),
              flush=True)
        del w_in, gate, merged, graphs
        torch.cuda.empty_cache()


main()
