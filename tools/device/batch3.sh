# Third device batch: plugin GPU tests (all), then the MoE and KDA benchmarks with their sweeps.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 240 python3 -m pytest -q -m gpu tests/plugins -p no:cacheprovider 2>&1 | tail -30 | tee $OUT/pytest.txt
timeout ${BENCH_S:-320} python3 tools/bench_plugins.py --sweep --only "${ONLY:-moe,kda}" 2>&1 | tee $OUT/bench.jsonl \
  | grep -v '"moe_tactic"\|"mla_config"'
grep '"moe_tactic"' $OUT/bench.jsonl | python3 -c "
import json,sys
rows=[json.loads(l) for l in sys.stdin]
for tpe in sorted({r['tokens_per_expert'] for r in rows}):
    best=sorted([r for r in rows if r['tokens_per_expert']==tpe], key=lambda r: r['ms'])[:4]
    print(tpe, [(r['tactic'], r['ms'], r['frac_of_floor'], r['tflops']) for r in best])"
