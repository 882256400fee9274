# Forty-eighth device batch (nineteenth session): the RMSNorm after AttnRes inside it (registry AttnRes v3, norm=1):
# its GPU tests and the GPU engine's, then the rank A/B in one process: the norms as separate launches again
# (--ab unfused-norm) and the MoE decode without this session's overlap (--ab moe-plain).
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -k "not tune" \
  tests/plugins/test_norm_gpu.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${RANK_S:-360} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} \
  --ab unfused-norm --ab moe-plain 2>&1 | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k.startswith(('step', 'batch', 'floor_ms', 'hbm', 'tokens'))})"
