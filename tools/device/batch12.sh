# Twelfth device batch (right after batch11): the MoE sweep over the paired layout's blocks (decode and prefill)
# and the FP8 prefill's, next to the build's tactics. Under 600 s.
source tools/device/env.sh
timeout ${MOE_S:-300} python3 tools/bench_plugins.py --sweep --only moe 2>&1 | tee $OUT/moe.jsonl \
  | grep -v '"moe_tactic"'
