# Sixth device batch (prepared for the next session): every GPU test, the MoE sweep (W4 vs the experimental
# strided-nibble tactics), one real-size rank with the engine's MoE and with the strided one. All three parts
# take more than one 600 s call: pick with PARTS (default "tests,moe"; then PARTS=rank in a second call).
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PARTS=${PARTS:-tests,moe}
if [[ $PARTS == *tests* ]]; then
  timeout ${TEST_S:-300} python3 -m pytest -q -m gpu tests/plugins tests/model/test_gpu_engine.py -p no:cacheprovider \
    -rf 2>&1 | tail -30 | tee $OUT/pytest.txt
fi
if [[ $PARTS == *moe* ]]; then
  timeout ${MOE_S:-250} python3 tools/bench_plugins.py --sweep --only moe 2>&1 | tee $OUT/moe.jsonl | grep -v '"moe_tactic"'
fi
if [[ $PARTS == *rank* ]]; then
  for moe in triton triton_s; do  # run as --moe engine / --moe strided before --moe-tactic replaced that flag
    timeout ${RANK_S:-200} python3 tools/bench_rank.py --batches 32,128 --reps 3 --moe-tactic $moe 2>&1 | grep '^{' \
      | tee $OUT/rank_$moe.jsonl
  done
fi
