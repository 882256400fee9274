# Hundred-and-second device batch (twenty-eighth session): the engine file on the async default, its preemption
# case now judged row by row against the same engine scoring each request's tokens (batch101 had judged the
# tokens against the CPU engine's top-1; preempt_probe.py then showed the pick that failed is a bf16 near-tie
# that batching flips, with or without preemption, sync and async alike).
source tools/device/env.sh
timeout 200 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E  |passed|failed" $OUT/pytest.txt | tail -12
