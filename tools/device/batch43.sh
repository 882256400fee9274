# Forty-third device batch (eighteenth session): the router top-k kernel at 8 warps (GPU tests, then the warps sweep),
# then the MoE decode blocks in the rank, A/B in one process (bench_rank.py --ab moe-bn128 --ab moe-stages4).
source tools/device/env.sh
timeout ${TEST_S:-100} python3 -m pytest -q -m gpu tests/plugins/test_router_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -5
timeout ${B_S:-300} python3 tools/bench_plugins.py --only router --sweep 2>&1 | grep -E '^\{|Error' > $OUT/router.jsonl
grep -E 'router_topk_warps' $OUT/router.jsonl | cut -c1-200
timeout ${RANK_S:-400} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} \
  --ab moe-bn128 --ab moe-stages4 2>&1 | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k.startswith(('step', 'batch', 'floor_ms', 'hbm'))})"
