# Hundred-and-eleventh device batch (prepared in the thirty-fourth session; not yet run): batch110 cut to what a
# short loan holds: the sampling bench (top-p by selection beside the sampler as it was; the draw as one Triton
# launch, triton_draw_ms; the penalties' kept counts) and the sampler's GPU tests (the Triton draw against the torch
# ops, GPU against CPU draws with either draw, penalties and their kept counts without a sync). If they pass and
# triton_draw_ms beats plain_ms, turn sampler.TRITON_DRAW on. Carry fla-core's wheel (.whl).
source tools/device/env.sh
timeout 120 python3 tools/bench_sampling.py --device cuda --steps 10 2>&1 | tee $OUT/sampling.jsonl
timeout 90 python3 -m pytest -q -m gpu tests/runtime/test_sampler_gpu.py -p no:cacheprovider --tb=short 2>&1 | tail -5
