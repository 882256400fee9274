# Twenty-first device batch (fourteenth session): the fused KDA decode walked its state BV value rows at a time
# with the next slice's load in flight. Its GPU tests, then the decode config sweep (split and fused, slices and
# warps) at 8 / 64 / 256 x 96 heads and at a rank's 6 heads x 32 / 64 / 128 sequences, without the prefill part.
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
cd tools/bench && timeout ${KDA_S:-200} python3 -c "
import kda, common, torch
kda.bench_kda_prefill = lambda bw, sweep: None
bw = common.hbm_read_tbps()
common.emit(bench='env', device=torch.cuda.get_device_name(), hbm_read_tbps=round(bw, 3))
kda.bench_kda(bw, True)
" 2>&1 | grep '^{' | tee $OUT/kda.jsonl
