# Forty-fifth device batch (nineteenth session): the MoE decode as the rank sees it (a varying count of its 56
# experts touched, one token each: bench_plugins --only moe_touched), then the rank A/B with 32-row blocks.
source tools/device/env.sh
timeout ${SWEEP_S:-150} python3 tools/bench_plugins.py --only moe_touched 2>&1 | grep '^{' | tee $OUT/touched.jsonl
timeout ${RANK_S:-400} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} \
  --ab moe-bn32 --ab moe-bn32-w2 2>&1 | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k.startswith(('step', 'batch', 'floor_ms', 'hbm', 'tokens'))})"
