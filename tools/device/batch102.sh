# Hundred-and-second device batch (twenty-eighth session): the preemption case of batch101 judged against the fp32
# engine (batch101: both modes picked token 486 where the bf16 CPU engine's top-1, 408, was 0.065 std above it,
# request 2 step 4, against a bar of 0.05 std); the whole engine file again on the default.
source tools/device/env.sh
timeout 200 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E  |passed|failed" $OUT/pytest.txt | tail -12
