# Fifty-second device batch (twentieth session): the session's final code (overlap_combine removed): the MoE and
# whole-engine GPU tests, then the rank with the overlap A/B (--ab moe-plain) as the session's figure.
source tools/device/env.sh
source tools/device/rank_ab.sh
timeout ${TEST_S:-240} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/model/test_gpu_engine.py -k "not tune" \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
rank_ab moe-plain
