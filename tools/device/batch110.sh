# Hundred-and-tenth device batch (prepared in the thirty-fourth session, run in the thirty-fifth on that session's
# code, 6c3822b, whose sampler.top_p_keep_sorted it names; BENCHMARKS.md has its figures):
# 1. the sampling bench: top-p without a sort of the vocabulary (sampler.top_p_keep) beside the sampler as it was
#    (before_ms), the draw as one Triton launch (triton_draw_ms, k3plugins.sample); the penalties' counts kept on
#    the sampling rank (penalized_ms: a step after the first; penalized_first_ms: the first, which brings the whole
#    output); and
#    plain sampling's parts at 32 and 128 rows (the noise; the draw as torch ops and as one launch; top-p's kept set
#    by selection and by sorting);
# 2. bench_plugins' MLA with one wave's split counts beside the host's two;
# 3. the GPU tests of the sampler and of the engine. Carry fla-core's wheel (.whl).
source tools/device/env.sh
timeout 150 python3 tools/bench_sampling.py --device cuda 2>&1 | tee $OUT/sampling.jsonl
python3 - <<'PY' 2>&1 | tee $OUT/sampling_parts.txt
import torch
from k3runtime import sampler
def ms(f, reps=20):
    for _ in range(3):
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
for M in (32, 128):
    x = torch.randn(M, 163840, device="cuda") * 3
    tp = torch.full((M,), 0.95, dtype=torch.float64, device="cuda")
    seeds = torch.arange(M, device="cuda") * 7919
    ids = torch.arange(163840, device="cuda")
    print(M, {"noise": round(ms(lambda: sampler.gumbel_noise(seeds, ids)), 3),
              "draw_torch": round(ms(lambda: (x + sampler.gumbel_noise(seeds, ids)).argmax(-1)), 3),
              "draw_triton": round(ms(lambda: sampler._triton_draw()(x, seeds)), 3),
              "keep_select": round(ms(lambda: sampler.top_p_keep(x, tp)), 3),
              "keep_sorted": round(ms(lambda: sampler.top_p_keep_sorted(x, tp)), 3),
              "same": bool(torch.equal(sampler.top_p_keep(x, tp), sampler.top_p_keep_sorted(x, tp))),
              "max": round(ms(lambda: x.max(-1)), 3)})
PY
timeout 150 python3 tools/bench_plugins.py --only mla 2>&1 | grep '^{' > $OUT/mla.jsonl
python3 - <<'PY'
import json, os
for r in map(json.loads, open(f"{os.environ['OUT']}/mla.jsonl")):
    if r["bench"] == "mla_config":
        print(r["B"], r["L"], r["H"], r["block_h"], r["num_splits"], r["ms"], r["frac_of_floor"])
PY
timeout 150 python3 -m pytest -q -m gpu tests/runtime/test_sampler_gpu.py tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short 2>&1 | tail -5
