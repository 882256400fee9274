# Thirty-fourth device batch (seventeenth session): the engine's GPU tests with the Router forked onto a side
# stream, the rank again, then MoE prefill (128 tokens/expert) with the previous layout's decode (rotations,
# HEAD a31f0db's plugins, made for this run as exp34/old/k3plugins by `git archive a31f0db plugins`) and with the
# shifts, one process each, both checked against the reference.
source tools/device/env.sh
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${RANK_S:-200} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} 2>&1 \
  | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode' | cut -c1-330
prefill() {  # name, directory holding a k3plugins package to put first on the path ("" = the working tree)
  (cd tools/bench && PYTHONPATH=${2:+$PWD/../../$2:}$PYTHONPATH timeout 150 python3 -c "
import torch, common, moe
from k3plugins.moe import triton as mt
from k3plugins.moe.reference import moe_experts as moe_ref
gen = torch.Generator(device='cuda').manual_seed(0)
w = moe.make_weights(gen)
t = mt.TACTICS['prefill_p']
a = (mt.lay_out(t, w[0]), mt.lay_out_scale(t, w[1]), mt.lay_out(t, w[2]), mt.lay_out_scale(t, w[3]))
z, ids, tw = moe.make_tokens(1, gen)
z, ids, tw = z[:37], ids[:37], tw[:37]
ref = moe_ref(z, ids, tw, *w, expert_start=moe.E_START, act='situ')
out = mt.moe_experts(z, ids, tw, *a, expert_start=moe.E_START, act='situ', tactic='prefill_p')
z, ids, tw = moe.make_tokens(128, gen)
flops = 2 * z.shape[0] * 3 * moe.DL * moe.INTER
fn = lambda: mt.moe_experts(z, ids, tw, *a, expert_start=moe.E_START, act='situ', tactic='prefill_p')
for rep in range(2):
    ms = common.time_ms(fn, rep=30)
    common.emit(bench='moe_prefill_variant', variant='$1', rel_l2=common.rel_l2(out, ref), ms=round(ms, 4),
                tflops=round(flops / ms / 1e9, 1))
" 2>&1 | grep -E '^\{|Error|error' | tee -a $OUT/prefill.jsonl)
}
prefill rotations tools/device/exp34/old
prefill shifts ""
prefill rotations_again tools/device/exp34/old
