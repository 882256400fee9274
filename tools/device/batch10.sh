# Tenth device batch (prepared for the next session, after batch9): the experimental paired layout and FP8
# prefill. GPU tests, the MoE sweep (both next to strided), then the rank with the build's tactic and triton_p.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/model/test_gpu_engine.py \
  -k "moe or tune or strided" -p no:cacheprovider --tb=short 2>&1 \
  | grep -E "assert|Error|passed|failed" | tail -10 | tee $OUT/pytest.txt
timeout ${MOE_S:-230} python3 tools/bench_plugins.py --sweep --only moe 2>&1 | tee $OUT/moe.jsonl | grep -v '"moe_tactic"'
for t in triton_s triton_p; do
  timeout ${RANK_S:-80} python3 tools/bench_rank.py --batches 32,128 --reps 3 --moe-tactic $t 2>&1 | grep '^{' \
    | tee -a $OUT/rank.jsonl
done
