# Thirty-seventh device batch (seventeenth session; batch36's machine was taken back before it reported): the
# engine's GPU tests with the Router fork's 64-token threshold, then the rank with the session's defaults.
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${RANK_S:-200} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-20} 2>&1 \
  | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' | cut -c1-330
