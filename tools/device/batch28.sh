# Twenty-eighth device batch (sixteenth session): the fused KDA decode with its loads together and the register
# cap by grid (fused_maxnreg) as the engine's default. The KDA and engine GPU tests, the rank, then the KDA bench
# (decode and prefill, no sweep).
source tools/device/env.sh
timeout ${TEST_S:-220} python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${RANK_S:-190} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} 2>&1 \
  | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' | cut -c1-300
timeout ${KDA_S:-150} python3 tools/bench_plugins.py --only kda 2>&1 | grep '^{' > $OUT/kda.jsonl
grep -E '"kda_decode"|"kda_prefill"|env' $OUT/kda.jsonl | cut -c1-700
