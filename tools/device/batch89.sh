# Eighty-ninth device batch (twenty-fifth session): the final code's step inside its graph at 32 and 128 requests
# (--timeline: the top-k launch with its final cast policy), and moe_tail_probe on common.cuda_events.
source tools/device/env.sh
timeout 150 python3 tools/bench_rank.py --batches 32,128 --reps 5 --timeline 2>&1 | grep '^{' > $OUT/timeline.jsonl
python3 -c "
import json
for l in open('$OUT/timeline.jsonl'):
    d = json.loads(l)
    if d['bench'] == 'rank_timeline':
        print(d['batch'], [g for g in d['groups'] if g[0].startswith(('router_topk', 'sort_pairs', 'attn_res'))])
    if d['bench'] == 'rank_decode':
        print({k: d[k] for k in ('batch', 'step_ms', 'step_x_floor')})
"
timeout 90 python3 tools/device/moe_tail_probe.py 2>&1 | grep '^{' | cut -c 1-300
