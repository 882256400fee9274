# Sixth device batch (prepared for the next session): every GPU test, then the MoE sweep (W4 vs the experimental
# strided-nibble tactics), then one real-size rank with the engine's MoE and with the strided one.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-300} python3 -m pytest -q -m gpu tests/plugins tests/model/test_gpu_engine.py -p no:cacheprovider -rf \
  2>&1 | tail -30 | tee $OUT/pytest.txt
timeout ${MOE_S:-200} python3 tools/bench_plugins.py --sweep --only moe 2>&1 | tee $OUT/moe.jsonl | grep -v '"moe_tactic"'
for moe in engine strided; do
  timeout ${RANK_S:-150} python3 tools/bench_rank.py --batches 32,128 --reps 3 --moe $moe 2>&1 | grep '^{' \
    | tee $OUT/rank_$moe.jsonl
done
