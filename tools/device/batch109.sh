# Its bench ran in the thirty-third session on an H100 (BENCHMARKS.md, bench_sampling); on an H200 not yet.
# Hundred-and-ninth device batch (prepared in the thirty-third session): what a decode step's sampling
# costs on the GPU with penalties and with logprobs, beside plain sampling and the floor of reading the logits once
# (tools/bench_sampling.py: 32 and 128 rows, K3's vocabulary, 1K and 8K earlier output tokens a row). The penalties'
# counts are made on the device from the plan's token lists (runtime/penalties.py), so their host work grows with
# the output; this shows by how much. Then the GPU tests of the sampler (penalties and bans without a sync).
source tools/device/env.sh
timeout 240 python3 tools/bench_sampling.py --device cuda 2>&1 | tee $OUT/sampling.jsonl
timeout 200 python3 -m pytest -q -m gpu tests/runtime/test_sampler_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest_sampler.txt 2>&1
tail -3 $OUT/pytest_sampler.txt
