# Ran at the commit before its revert; the hi_shift field and switch were reverted after this run (BENCHMARKS.md).
# Seventy-third device batch (twenty-third session): the lane decode's right shift as a high multiply
# (MoETactic.hi_shift): the touched-experts sweep beside decode_l (each variant checked against the reference
# first), then the rank with --ab moe-hi-shift (one process).
source tools/device/env.sh
timeout 150 python3 tools/bench_plugins.py --only moe_touched 2>&1 | grep '^{' | tee $OUT/moe_touched.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l)
    if d['bench']=='moe_touched': print(d['touched'], {k: d[k] for k in ('decode_p_ms', 'decode_l_ms', 'decode_l_hi_ms')})
    elif d['bench']=='moe_touched_check': print(d)"
source tools/device/rank_ab.sh
RANK_S=220 rank_ab moe-hi-shift
