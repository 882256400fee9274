# Seventy-ninth device batch (twenty-fourth session): prefill_l ran at 292-300 TFLOP/s in batch75 and batch76
# against prefill_p's 322-332 (314.6 against 306.8 on batch69's): the MoE sweep (bench_plugins --only moe --sweep),
# its lane prefill blocks among them.
source tools/device/env.sh
timeout 420 python3 tools/bench_plugins.py --only moe --sweep 2>&1 | grep '^{' | tee $OUT/moe_sweep.jsonl \
  | grep -E '"tokens_per_expert": 128|"bench": "moe"' | cut -c1-200
