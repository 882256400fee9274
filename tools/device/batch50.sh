# Fiftieth device batch (written in the nineteenth session, not run: no device time was left): the MoE combine
# kernel overlapped too (MoETactic.overlap_combine: the down kernel counts each token's rows of y, the combine
# kernel launched with PDL awaits them): the overlap GPU tests with it, the touched-experts sweep, then the rank
# A/B (--ab moe-overlap-combine). Run in the twentieth session at 6fd4533; overlap_combine was then removed
# (slower), so this script needs that commit.
source tools/device/env.sh
source tools/device/rank_ab.sh
timeout ${TEST_S:-100} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "overlapped or decode_p" \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${SWEEP_S:-90} python3 tools/bench_plugins.py --only moe_touched 2>&1 | grep '^{' > $OUT/touched.jsonl
python3 -c "import json
for l in open('$OUT/touched.jsonl'):
    d = json.loads(l); print({k: v for k, v in d.items() if k in ('touched', 'decode_p_ms', 'overlap_combine_ms', 'variant', 'rel_l2')})"
rank_ab moe-overlap-combine
