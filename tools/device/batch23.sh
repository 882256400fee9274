# Twenty-third device batch (fifteenth session), one call on a fresh machine. The KDA and engine GPU tests (the
# prefill now takes q and k L2-normed from the conv kernel, chunk_kda without its own l2norm passes), then the KDA
# decode sweep with two things not yet run on a GPU: the fused kernel at a 168-register cap (three 4-warp programs
# an SM instead of two, 9 spill instructions in its sm_90 SASS) and the head pass (the fused grid's traffic, no
# math); then the prefill against chunk_kda alone, with both kernel profiles and each glue stage alone.
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
cd tools/bench && timeout ${KDA_S:-300} python3 -c "
import kda, common, torch
bw = common.hbm_read_tbps()
common.emit(bench='env', device=torch.cuda.get_device_name(), hbm_read_tbps=round(bw, 3))
kda.bench_kda(bw, True)
" 2>&1 | grep '^{' | tee $OUT/kda.jsonl | grep -E '"kda_decode"|"fused"|prefill'
