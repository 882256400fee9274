# Sixty-ninth device batch (twenty-third session): the MoE sweep with the lane layout's prefill blocks (BM 64 / 128,
# the packed PTX multiply on or off) beside prefill_p, at 1-8 and 128 tokens/expert.
source tools/device/env.sh
timeout 400 python3 tools/bench_plugins.py --only moe --sweep 2>&1 | grep '^{' | grep -v moe_tile_pass | tee $OUT/moe.jsonl \
  | grep -E '"tokens_per_expert": 128|"bench": "moe"' | cut -c1-260
