# Twenty-third device batch (for the fifteenth session), one call on a fresh machine: the KDA decode sweep with two
# things not yet run on a GPU: the fused kernel at a 168-register cap (three 4-warp programs an SM instead of two,
# 9 spill instructions in its sm_90 SASS) and the head pass (the fused grid's traffic, no math), which says how
# much of the fused tactic's 0.77 of the floor at 64 x 96 its one-tile-a-program grid costs by itself.
source tools/device/env.sh
cd tools/bench && timeout ${KDA_S:-200} python3 -c "
import kda, common, torch
kda.bench_kda_prefill = lambda bw, sweep: None
bw = common.hbm_read_tbps()
common.emit(bench='env', device=torch.cuda.get_device_name(), hbm_read_tbps=round(bw, 3))
kda.bench_kda(bw, True)
" 2>&1 | grep '^{' | tee $OUT/kda.jsonl | grep -E '"kda_decode"|"fused"'
