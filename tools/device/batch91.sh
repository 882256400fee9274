# Ninety-first device batch (twenty-sixth session): the decode graphs' staging rewriting only the page rows that
# changed (fill_rows' `written`): the graph tests, then the rank's step over three processes; each rank_decode record
# has stage_ms (the staging alone, steady decode), graph_ms (the graph on staged inputs) and launch_ms (the host's
# launch call).
source tools/device/env.sh
timeout 200 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/runtime/test_pp_graphs_gpu.py \
  tests/dist/test_graphs_nccl_gpu.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
tail -3 $OUT/pytest.txt
source tools/device/rank_ab.sh
for i in 1 2 3; do RANK_S=80 RANK_OUT=rank_$i rank_ab; done
python3 -c "
import json
for i in (1, 2, 3):
    for l in open('$OUT/rank_%d.jsonl' % i):
        d = json.loads(l)
        if d['bench'] == 'rank_decode':
            print(i, {k: d[k] for k in ('batch', 'step_ms', 'graph_ms', 'stage_ms', 'launch_ms', 'step_x_floor')})
"
