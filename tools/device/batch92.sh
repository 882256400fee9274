# Ninety-second device batch (twenty-sixth session): the fused KDA decode applying f_b itself (one launch less a KDA
# layer): its GPU tests and the engine's, bench_plugins' KDA section (fused_f_b_inside_ms against
# fused_after_f_b_gemm_ms at 8/64/256 x 96 heads), then the rank with --ab kda-f-b-gemm in one process (its
# rank_decode records carry the step's parts: graph_ms, host_stage_ms, host_launch_ms, gpu_step_ms).
source tools/device/env.sh
timeout 170 python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
tail -3 $OUT/pytest.txt
timeout 100 python3 tools/bench_plugins.py --only kda 2>&1 | grep '^{' > $OUT/kda.jsonl
python3 -c "
import json
for l in open('$OUT/kda.jsonl'):
    d = json.loads(l)
    if d['bench'] == 'kda_decode':
        print({k: d[k] for k in ('N', 'floor_ms', 'fused_ms', 'fused_after_f_b_gemm_ms', 'fused_f_b_inside_ms')})
"
source tools/device/rank_ab.sh
RANK_S=170 RANK_OUT=rank_ab rank_ab kda-f-b-gemm
python3 -c "
import json
for l in open('$OUT/rank_ab.jsonl'):
    d = json.loads(l)
    if d['bench'] == 'rank_decode':
        print({k: d[k] for k in ('batch', 'step_ms', 'step_ms_kda_f_b_gemm', 'graph_ms', 'host_stage_ms',
                                 'host_launch_ms', 'gpu_step_ms', 'step_x_floor')})
"
