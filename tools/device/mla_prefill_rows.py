"""The MLA prefill rows (bench_mla_prefill): the standard PREFILL_CASES, then short chunks at 96, 16 and 6 heads (a
TP16 rank's) around the MHA form's thresholds (prefill.min_new_tokens: 128 to 256 new tokens by heads; the FLOP
break-even about 170). JSON lines on stdout. `--short`: the short chunks only; `--rows C,N,H ...`: these rows only
(cached, new tokens, heads)."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import mma_tflops  # noqa: E402
from mla import PREFILL_CASES, bench_mla_prefill  # noqa: E402

SHORT = ((2048, 128, 96), (2048, 192, 96), (8192, 192, 96), (2048, 256, 16), (2048, 192, 16), (2048, 128, 16),
         (2048, 64, 16), (2048, 256, 6), (2048, 192, 6), (2048, 128, 6), (2048, 64, 6), (8192, 128, 6))

tflops = mma_tflops()
print(json.dumps({"mma_tflops": round(tflops, 1)}))
gen = torch.Generator(device="cuda").manual_seed(0)
if "--rows" in sys.argv:
    rows = [tuple(map(int, r.split(","))) for r in sys.argv[sys.argv.index("--rows") + 1:]]
else:
    rows = SHORT if "--short" in sys.argv else PREFILL_CASES + SHORT
for cached, chunk, H in rows:
    bench_mla_prefill(tflops, gen, cached=cached, chunk=chunk, H=H)
