# Forty-sixth device batch (nineteenth session): the MoE down kernel overlapping the gate/up kernel's drain
# (MoETactic.overlap): its GPU tests (bitwise equal to the plain launches over graph replays), the MoE GPU tests,
# then the touched-experts sweep with the grid rows first and with the overlap.
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${SWEEP_S:-150} python3 tools/bench_plugins.py --only moe_touched 2>&1 | grep '^{' | tee $OUT/touched.jsonl
