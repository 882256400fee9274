# Forty-second device batch (eighteenth session): the router's top-k kernel warps, then the rank's A/B switches again,
# now replayed in turn over five rounds in one process (bench_rank.py --ab).
source tools/device/env.sh
timeout ${B_S:-300} python3 tools/bench_plugins.py --only router --sweep 2>&1 | grep -E '^\{|Error' \
  > $OUT/router.jsonl
grep -E '"router"|router_best|topk_warps' $OUT/router.jsonl | cut -c1-200
timeout ${RANK_S:-400} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} \
  --ab moe-compact --ab old-router-blocks 2>&1 | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k.startswith(('step', 'batch', 'floor_ms', 'hbm'))})"
