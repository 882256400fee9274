# Ran at commit 47e8d1f; its down_splits field and switches were reverted after this run (BENCHMARKS.md).
# Seventy-second device batch (twenty-third session): the MoE down kernel split along K (MoETactic.down_splits):
# its GPU tests, the touched-experts sweep beside decode_l, then the rank with --ab moe-down-split2/3 (one process).
source tools/device/env.sh
timeout 150 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "overlapped" 2>&1 | tail -2
timeout 150 python3 tools/bench_plugins.py --only moe_touched 2>&1 | grep '^{' | tee $OUT/moe_touched.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l)
    if d['bench']=='moe_touched': print(d['touched'], {k: d[k] for k in d if k.endswith('_ms')})
    elif d['bench']=='moe_touched_check': print(d)"
source tools/device/rank_ab.sh
RANK_S=260 rank_ab moe-down-split2 moe-down-split3
