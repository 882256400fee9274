# Thirty-sixth device batch (seventeenth session): the engine's GPU tests with the Router fork's 64-token
# threshold, then the MoE block sweep again (the shift decode moved work off the ALU pipe: does another decode
# block now win?).
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${MOE_S:-300} python3 tools/bench_plugins.py --only moe --sweep 2>&1 | grep '^{' | tee $OUT/moe.jsonl \
  | grep -E '"moe"|moe_tactic' | cut -c1-250
