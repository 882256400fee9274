# Thirtieth device batch (sixteenth session): the MoE grid in (row blocks, experts) order (MoETactic.rows_first),
# so that the programs running together share an expert's tokens (its x tile stays in L2), side by side with the
# (experts, row blocks) order, at decode and prefill sizes; each output against the default tactic's.
source tools/device/env.sh
(cd tools/bench && timeout ${MOE_S:-240} python3 -c "
import dataclasses, torch, common, moe
from k3plugins.moe import triton as mt
bw = common.hbm_read_tbps()
common.emit(bench='env', device=torch.cuda.get_device_name(), hbm_read_tbps=round(bw, 3))
gen = torch.Generator(device='cuda').manual_seed(0)
w = moe.make_weights(gen)
floor_ms = sum(t.numel() for t in w) / (bw * 1e12) * 1e3
lay = lambda t: (mt.lay_out(t, w[0]), mt.lay_out_scale(t, w[1]), mt.lay_out(t, w[2]), mt.lay_out_scale(t, w[3]))
untiled = mt.MoETactic(128, 128, 256, 8, 2, strided=True, paired=True)
for tpe, base in ((1, 'decode_p'), (8, 'decode_p'), (128, 'prefill_p'), (128, untiled)):
    z, ids, tw = moe.make_tokens(tpe, gen)
    flops = 2 * z.shape[0] * 3 * moe.DL * moe.INTER
    t0 = mt.TACTICS[base] if isinstance(base, str) else base
    ref = None
    for t in (t0, dataclasses.replace(t0, rows_first=True)):
        a = lay(t)
        fn = lambda: mt.moe_experts(z, ids, tw, *a, expert_start=moe.E_START, act='situ', tactic=t)
        out = fn().float()
        ref = out if ref is None else ref
        ms = common.time_ms(fn)
        common.emit(bench='moe_grid_order', tokens_per_expert=tpe, tactic=str(base) if isinstance(base, str) else 'untiled_bm128_bn128', rows_first=t.rows_first,
                    ms=round(ms, 4), frac_of_floor=round(floor_ms / ms, 3), tflops=round(flops / ms / 1e9, 1),
                    rel_l2_vs_experts_first=common.rel_l2(out, ref))
" 2>&1 | grep -E '^\{|Error|error' | tee $OUT/moe.jsonl)
