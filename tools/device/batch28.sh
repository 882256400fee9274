# Twenty-eighth device batch (sixteenth session): the fused KDA decode with its loads together and the register
# cap by grid (fused_maxnreg) as the engine's default. The KDA and engine GPU tests, then the rank.
source tools/device/env.sh
timeout ${TEST_S:-230} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/plugins/test_kda_gpu.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${RANK_S:-190} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} 2>&1 \
  | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' | cut -c1-300
