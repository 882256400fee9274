"""The un-absorbed MLA prefill (prefill.mha_prefill) at a few query-block shapes: 6 heads (a TP16 rank's), 16 and 96,
short and long chunks. At 6 heads a 2048-token chunk is 6 x 16 programs of 128 rows, under one wave of an H100's
132 SMs; 64-row blocks double the programs. JSON lines: each shape's ms and its output against the default's."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import rel_l2, time_ms  # noqa: E402
from k3plugins.mla import prefill  # noqa: E402
from mla import PAGE, SCALE, prefill_inputs  # noqa: E402

CONFIGS = ((128, 8), (64, 4), (64, 8), (32, 4))
gen = torch.Generator(device="cuda").manual_seed(0)
for H in (6, 16, 96):
    for cached, chunk in ((2048, 256), (2048, 512), (2048, 2048), (8192, 2048)):
        total = cached + chunk
        pages = total // PAGE
        kv, q, w_uk, w_uv = prefill_inputs(gen, pages, chunk, H)
        pt = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)
        rec, outs = dict(bench="mha_prefill_blocks", H=H, cached=cached, chunk=chunk), {}
        for bm, nw in CONFIGS:
            out = torch.empty(chunk, H, 128, dtype=torch.bfloat16, device="cuda")
            fn = lambda: prefill.mha_prefill(q, kv, pt, total, w_uk, w_uv, scale=SCALE, out=out, block_m=bm,  # noqa
                                             num_warps=nw)
            rec[f"bm{bm}_w{nw}_ms"] = round(time_ms(fn, rep=10), 4)
            fn()
            outs[(bm, nw)] = out.float()
        base = rec["bm128_w8_ms"]
        for (bm, nw), o in outs.items():
            rec[f"bm{bm}_w{nw}_x_default"] = round(rec[f"bm{bm}_w{nw}_ms"] / base, 3)
            rec[f"bm{bm}_w{nw}_rel_l2"] = rel_l2(o, outs[(128, 8)])
        print(json.dumps(rec), flush=True)
