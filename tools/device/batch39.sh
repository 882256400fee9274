# Thirty-ninth device batch (eighteenth session): the GPU engine and MoEOutProj tests after the three-sequence
# helper refactor, MoEOutProj at op level (batch38, never run), and one profiled eager step at 32 and 128 requests.
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/plugins/test_moe_out_gpu.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${B_S:-120} python3 tools/bench_plugins.py --only moe_out 2>&1 | grep -E '^\{|Error' | tee $OUT/moe_out.jsonl \
  | cut -c1-400
for n in ${PROF_BATCHES:-32 128}; do
  timeout ${PROF_S:-150} python3 tools/bench_rank.py --batches $n --reps 3 --profile 2>&1 | grep '^{' \
    > $OUT/profile$n.jsonl; tail -c 200 $OUT/profile$n.jsonl
done
