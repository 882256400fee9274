# Forty-seventh device batch (nineteenth session): the MoE down kernel summing each token's pairs itself
# (MoETactic.combine_in_down): the overlap GPU tests with and without it (bitwise equal to the plain launches over
# graph replays), then the touched-experts sweep with it.
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "overlapped or decode_p" \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${SWEEP_S:-150} python3 tools/bench_plugins.py --only moe_touched 2>&1 | grep '^{' | tee $OUT/touched.jsonl
