# Forty-first device batch (eighteenth session): the MoE (with the compact grid) and router (swept blocks) GPU tests,
# then the rank with each change flipped in the same process (bench_rank.py --ab).
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/plugins/test_router_gpu.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${RANK_S:-330} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} \
  --ab moe-compact --ab old-router-blocks 2>&1 | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k.startswith(('step', 'batch', 'floor_ms', 'hbm'))})"
