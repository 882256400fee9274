# Hundred-and-thirteenth device batch (thirty-fifth session): top-p's kept set by Triton's histograms
# (k3plugins.sample.top_p, sampler.TRITON_TOP_P): its GPU tests against the sort and in the GPU-against-CPU draws,
# the part alone against the sort's (with a profile of its kernels), and the sampling bench (triton_top_p_ms beside
# sorted_top_p_ms and before_ms). Run twice on an H100 in the thirty-fifth session on two earlier forms, and twice on
# an H100 in the thirty-sixth on the tree's form (BENCHMARKS.md). Carry fla-core's wheel (.whl).
source tools/device/env.sh
timeout 150 python3 -m pytest -q -m gpu tests/runtime/test_sampler_gpu.py -p no:cacheprovider --tb=short 2>&1 | tail -8
python3 - <<'PY' 2>&1 | tee $OUT/top_p_parts.txt
import sys
import torch
sys.path.insert(0, "tools/bench")
from common import time_ms
from k3runtime import sampler
from k3plugins.sample.top_p import top_p_filter
ms = lambda f: time_ms(f, graph=False, flush=False)  # medians of 20, launched as the sampler does
for M in (32, 128):
    x = torch.randn(M, 163840, device="cuda") * 3 / 0.8
    tp = torch.full((M,), 0.95, dtype=torch.float64, device="cuda")
    sort = lambda: x.masked_fill(~sampler.top_p_keep(x, tp), float("-inf"))
    print(M, {"sort_ms": round(ms(sort), 3), "histograms_ms": round(ms(lambda: top_p_filter(x, tp)), 3),
              "same": bool(torch.equal(sort(), top_p_filter(x, tp)))})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            top_p_filter(x, tp)
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        print("  ", e.key[:50], e.count, round(e.device_time_total / e.count, 1), "us")
PY
timeout 120 python3 tools/bench_sampling.py --device cuda --steps 10 2>&1 | tee $OUT/sampling.jsonl
