# Forty-fourth device batch (eighteenth session): the residual add fused into AttnRes (registry v2): the GPU engine
# and AttnRes tests, then the rank with the adds as separate launches A/B in one process (--ab unfused-residual).
source tools/device/env.sh
timeout ${TEST_S:-170} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -k "not tune" \
  tests/plugins/test_norm_gpu.py::test_attn_res_matches_reference \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${RANK_S:-300} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} \
  --ab unfused-residual 2>&1 | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k.startswith(('step', 'batch', 'floor_ms', 'hbm', 'tokens'))})"
