# Twenty-fourth device batch (fifteenth session), after batch23: the KDA and engine GPU tests with the fused decode's
# register cap as its default and the conv prefill's one-sequence walk (rows loaded two ahead, no per-row sequence
# lookups); the KDA sweep (decode configs, prefill with its kernel profiles, conv tiles); then the rank.
source tools/device/env.sh
timeout ${TEST_S:-220} python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
(cd tools/bench && timeout ${KDA_S:-200} python3 -c "
import kda, common, torch
bw = common.hbm_read_tbps()
common.emit(bench='env', device=torch.cuda.get_device_name(), hbm_read_tbps=round(bw, 3))
kda.bench_kda(bw, True)
" 2>&1 | grep '^{' > $OUT/kda.jsonl)
grep -E '"kda_decode"|"kda_prefill"|breakdown' $OUT/kda.jsonl | cut -c1-400
timeout ${RANK_S:-170} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} 2>&1 \
  | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' | cut -c1-300
