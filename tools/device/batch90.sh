# Ninetieth device batch (for the twenty-sixth session; not run yet): the decode graphs' vectorised host staging
# (cuda_graph.fill_rows) on the GPU: the graph tests, then the rank's step over three processes and one profiled
# replay at 32 and 128 requests (--timeline: busy time as the union of the launches, the longest gaps); each
# rank_decode record has stage_ms, the staging alone on the device host.
source tools/device/env.sh
timeout 200 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/runtime/test_pp_graphs_gpu.py \
  tests/dist/test_graphs_nccl_gpu.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
tail -3 $OUT/pytest.txt
source tools/device/rank_ab.sh
for i in 1 2 3; do RANK_S=70 RANK_OUT=rank_$i rank_ab; done
timeout 120 python3 tools/bench_rank.py --batches 32,128 --reps 5 --timeline 2>&1 | grep '^{' > $OUT/timeline.jsonl
python3 -c "
import json
for l in open('$OUT/timeline.jsonl'):
    d = json.loads(l)
    if d['bench'] == 'rank_timeline':
        print(d['batch'], {k: d[k] for k in ('span_us', 'busy_us', 'idle_us', 'kernels_us')}, d['longest_gaps'][:6])
"
