# Thirty-first device batch (seventeenth session): the paired MXFP4 layout decoded with plain shifts instead of
# rotations (ptxas puts left shifts on the FMA pipe as IMAD.SHL, relieving the ALU pipe ncu found bound), side by
# side with the previous layout (HEAD's plugins) and with the one right shift as a high multiply (umulhi); each
# process checks its output against the torch reference first. Then ncu's pipe use for the two new variants.
# The variant packages were made for this run and not kept: exp31/old/k3plugins = `git archive a31f0db plugins`
# (the rotations), exp31/umulhi/k3plugins = the working tree with pair 3's right shift as tl.umulhi(w & (MAG << 7),
# 1 << 25).
source tools/device/env.sh
variant() {  # name, directory holding a k3plugins package to put first on the path ("" = the working tree)
  (cd tools/bench && PYTHONPATH=${2:+$PWD/../../$2:}$PYTHONPATH timeout ${VAR_S:-150} python3 -c "
import torch, common, moe, k3plugins
from k3plugins.moe import triton as mt
from k3plugins.moe.reference import moe_experts as moe_ref
bw = common.hbm_read_tbps()
gen = torch.Generator(device='cuda').manual_seed(0)
w = moe.make_weights(gen)
floor_ms = sum(t.numel() for t in w) / (bw * 1e12) * 1e3
t = mt.TACTICS['decode_p']
a = (mt.lay_out(t, w[0]), mt.lay_out_scale(t, w[1]), mt.lay_out(t, w[2]), mt.lay_out_scale(t, w[3]))
z, ids, tw = moe.make_tokens(1, gen)
z, ids, tw = z[:37], ids[:37], tw[:37]
ref = moe_ref(z, ids, tw, *w, expert_start=moe.E_START, act='situ')
out = mt.moe_experts(z, ids, tw, *a, expert_start=moe.E_START, act='situ', tactic='decode_p')
common.emit(bench='variant_check', variant='$1', package=k3plugins.__file__, rel_l2=common.rel_l2(out, ref),
            hbm_read_tbps=round(bw, 3))
for tpe in (1, 2, 4, 8):
    z, ids, tw = moe.make_tokens(tpe, gen)
    fn = lambda: mt.moe_experts(z, ids, tw, *a, expert_start=moe.E_START, act='situ', tactic='decode_p')
    ms = common.time_ms(fn, rep=50)
    common.emit(bench='moe_decode_variant', variant='$1', tokens_per_expert=tpe, ms=round(ms, 4),
                frac_of_floor=round(floor_ms / ms, 3))
" 2>&1 | grep -E '^\{|Error|error' | tee -a $OUT/variants.jsonl)
}
variant rotations tools/device/exp31/old
variant shifts ""
variant shifts_umulhi tools/device/exp31/umulhi
variant rotations_again tools/device/exp31/old
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for v in shifts umulhi; do
  P=""; [ $v = umulhi ] && P=$PWD/tools/device/exp31/umulhi:
  PYTHONPATH=$P$PYTHONPATH timeout ${NCU_S:-100} $NCU --clock-control none -k regex:'moe_gate_up|moe_down' \
    --launch-count 2 --section SpeedOfLight --section WarpStateStats --section InstructionStats \
    --section ComputeWorkloadAnalysis -o $OUT/$v -f python3 tools/profile_kernels.py --kda-sequences 0 \
    > $OUT/ncu_$v.txt 2>&1
  [ -f $OUT/$v.ncu-rep ] && $NCU -i $OUT/$v.ncu-rep --page raw --csv > $OUT/raw_$v.csv 2>&1
  tail -2 $OUT/ncu_$v.txt
done
