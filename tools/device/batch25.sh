# Twenty-fifth device batch (fifteenth session), after batch24: the conv prefill's one-sequence walk unrolled by 4
# (the window's shift becomes renaming), SiLU as one fast division, no channel masks (BC divides D). In its sm_90
# SASS that is 121 instructions a row of 128 channels against 152. The KDA prefill with its conv tile sweep first,
# then the prefill GPU tests and the engine's.
source tools/device/env.sh
timeout ${BENCH_S:-150} python3 tools/bench_plugins.py --only kda_prefill --sweep 2>&1 | grep '^{' \
  > $OUT/kda_prefill.jsonl
grep -E '"kda_prefill"|breakdown' $OUT/kda_prefill.jsonl | cut -c1-400
grep -E 'kda_prefill_kernels' $OUT/kda_prefill.jsonl | cut -c1-300
timeout ${TEST_S:-120} python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py -k prefill -p no:cacheprovider \
  --tb=short > $OUT/pytest.txt 2>&1
timeout ${TEST_S:-120} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short \
  >> $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
