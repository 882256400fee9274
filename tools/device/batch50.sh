# Fiftieth device batch (written in the nineteenth session, not run: no device time was left): the MoE combine
# kernel overlapped too (MoETactic.overlap_combine: the down kernel counts each token's rows of y, the combine
# kernel launched with PDL awaits them): the overlap GPU tests with it, the touched-experts sweep, then the rank
# A/B (--ab moe-overlap-combine).
source tools/device/env.sh
timeout ${TEST_S:-100} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "overlapped or decode_p" \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${SWEEP_S:-90} python3 tools/bench_plugins.py --only moe_touched 2>&1 | grep '^{' | tee $OUT/touched.jsonl \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k in ('touched', 'decode_p_ms', 'plain_ms', 'overlap_combine_ms', 'variant', 'rel_l2')})"
timeout ${RANK_S:-280} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} \
  --ab moe-overlap-combine 2>&1 | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' \
  | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k.startswith(('step', 'batch', 'floor_ms', 'hbm', 'tokens'))})"
