"""Where top-p's list pays (LIST_MIN_ROWS): rows path against list path at 32-128 rows, graph time (GPU only) and
eager time (launches included, as the sampler runs), interleaved rounds, JSON lines."""
import json
import statistics
import sys

import torch

sys.path.insert(0, "tools/bench")
from common import time_ms  # noqa: E402
from k3plugins.sample import top_p as tp  # noqa: E402

keep = tp.LIST_MIN_ROWS
for M in (32, 48, 64, 80, 96, 128):
    x = torch.randn(M, 163840, device="cuda") * 3 / 0.8
    tpv = torch.full((M,), 0.95, dtype=torch.float64, device="cuda")
    res = {"rows": {"graph": [], "eager": []}, "list": {"graph": [], "eager": []}}
    outs = {}
    for _ in range(3):
        for path, lim in (("rows", 10 ** 9), ("list", 1)):
            tp.LIST_MIN_ROWS = lim
            outs[path] = tp.top_p_filter(x, tpv)
            res[path]["graph"].append(time_ms(lambda: tp.top_p_filter(x, tpv)))
            res[path]["eager"].append(time_ms(lambda: tp.top_p_filter(x, tpv), graph=False, flush=False))
    rec = {"M": M, "same": bool(torch.equal(outs["rows"], outs["list"]))}
    for path in res:
        for kind in ("graph", "eager"):
            rec[f"{path}_{kind}_ms"] = round(statistics.median(res[path][kind]), 4)
    print(json.dumps(rec), flush=True)
tp.LIST_MIN_ROWS = keep
