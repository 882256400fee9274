# Record only: the switches and the synced AttnRes it ran were reverted after this run (BENCHMARKS.md,
# twenty-fifth session).
# Eighty-third device batch (twenty-fifth session): the synced AttnRes with its waits polled by loads and its norm
# from the Gram matrices (one wait): GPU tests, the op's forms side by side (bench_plugins --only attn_res
# --sweep), and the rank with each change undone in one process (--ab).
source tools/device/env.sh
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_norm_gpu.py -k "attn_res" -p no:cacheprovider \
  --tb=short 2>&1 | tail -4
timeout 120 python3 tools/bench_plugins.py --only attn_res --sweep 2>&1 | grep '^{' > $OUT/attn_res.jsonl
python3 -c "
import json
for l in open('$OUT/attn_res.jsonl'):
    d = json.loads(l)
    if d.get('bench') == 'attn_res':
        print(d['M'], d['K'], d['norm'], {k[:-3]: v for k, v in d.items() if k.endswith('_ms') and k != 'floor_ms'})
"
source tools/device/rank_ab.sh
RANK_S=240 RANK_OUT=rank_ab rank_ab attn-res-two-launches attn-res-atomic-poll attn-res-two-waits
