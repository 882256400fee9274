# Hundred-and-fourteenth device batch (thirty-sixth session): top-p's mask with one tie weight a row (no exp a token),
# the first round's histogram in FIRST_COPIES copies a row (fewer atomic adds on one bucket at a time), the later
# rounds on a list of the first round's bucket (top_p_list_kernel, from LIST_MIN_ROWS rows): the GPU tests against the
# sort, then the kept set alone at 1 and 8 copies with each launch's time from a profile (named by its place in the
# call), then the sampling bench. Run on an H100 in the thirty-sixth session in two earlier forms (1-16 copies with
# the later rounds on the rows; the list at every size): BENCHMARKS.md. Carry fla-core's wheel (.whl).
source tools/device/env.sh
timeout 150 python3 -m pytest -q -m gpu tests/runtime/test_sampler_gpu.py -p no:cacheprovider --tb=short 2>&1 | tail -3
python3 - <<'PY' 2>&1 | tee $OUT/top_p_copies.txt
import statistics, sys
import torch
sys.path.insert(0, "tools/bench")
from common import time_ms
from k3runtime import sampler
from k3plugins.sample import top_p as tp
ms = lambda f: time_ms(f, graph=False, flush=False)  # medians of 20, launched as the sampler does
for M in (32, 128):
    x = torch.randn(M, 163840, device="cuda") * 3 / 0.8
    tpv = torch.full((M,), 0.95, dtype=torch.float64, device="cuda")
    want = x.masked_fill(~sampler.top_p_keep(x, tpv), float("-inf"))
    for copies in (1, 8):
        tp.FIRST_COPIES = copies
        rec = {"rows": M, "copies": copies, "ms": round(ms(lambda: tp.top_p_filter(x, tpv)), 3),
               "same": bool(torch.equal(tp.top_p_filter(x, tpv), want))}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                tp.top_p_filter(x, tpv)
            torch.cuda.synchronize()
        ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "top_p" in e.name),
                    key=lambda e: e.time_range.start)
        per_call = len(ev) // 10
        spans = {}
        for i, e in enumerate(ev):  # a call's launches in order, named with their place in it
            name = f"{i % per_call}_" + e.name.replace("top_p_", "").replace("_kernel", "")
            spans.setdefault(name, []).append(e.time_range.end - e.time_range.start)
        rec.update({k: round(statistics.median(v), 1) for k, v in spans.items()})
        print(rec, flush=True)
PY
timeout 120 python3 tools/bench_sampling.py --device cuda --steps 10 2>&1 | tee $OUT/sampling.jsonl
