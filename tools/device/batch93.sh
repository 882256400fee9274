# Ninety-third device batch (twenty-sixth session): the final code (decode graphs' inputs staged in one pinned buffer
# and one copy, page rows rewritten only when changed; the fused KDA decode applying f_b itself up to 1024
# programs): the graph and engine GPU tests with the KDA ones, then the rank's step over three processes; each
# rank_decode record carries the step's parts (host fill / upload / launch calls, synchronize against polling).
source tools/device/env.sh
timeout 230 python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py tests/model/test_gpu_engine.py \
  tests/runtime/test_pp_graphs_gpu.py tests/dist/test_graphs_nccl_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
tail -3 $OUT/pytest.txt
source tools/device/rank_ab.sh
for i in 1 2 3; do RANK_S=85 RANK_OUT=rank_$i rank_ab; done
python3 -c "
import json
for i in (1, 2, 3):
    for l in open('$OUT/rank_%d.jsonl' % i):
        d = json.loads(l)
        if d['bench'] == 'rank_decode':
            print(i, {k: v for k, v in d.items() if k.endswith('_ms') and not k.startswith(('eager', 'floor_all'))})
"
