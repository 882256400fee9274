# Forty-ninth device batch (nineteenth session): the AttnRes GPU tests again (the fused norm's comparison with the
# unfused launches now allows for the chunk partials summed in another order), AttnRes with and without the fused
# norm in both forms (bench_plugins --only attn_res), then the rank with AttnRes one program a token at every size.
source tools/device/env.sh
timeout ${TEST_S:-120} python3 -m pytest -q -m gpu tests/plugins/test_norm_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${SWEEP_S:-120} python3 tools/bench_plugins.py --only attn_res 2>&1 | grep '^{' | tee $OUT/attn_res.jsonl \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k in ('M', 'K', 'norm', 'token_ms', 'split512_ms', 'hbm_read_tbps')})"
timeout ${RANK_S:-300} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} \
  --ab attn-res-single 2>&1 | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k.startswith(('step', 'batch', 'floor_ms', 'hbm', 'tokens'))})"
