# Fortieth device batch (eighteenth session): the router's logits kernel swept at the rank's batch sizes (32, 64,
# 128 tokens), both MMA orientations (SWAP), tiles, K splits, warps and stages.
source tools/device/env.sh
timeout ${B_S:-400} python3 tools/bench_plugins.py --only router --sweep 2>&1 | grep -E '^\{|Error' \
  > $OUT/router.jsonl
grep -E '"router"|router_best' $OUT/router.jsonl | cut -c1-300
