# Thirty-eighth device batch (seventeenth session): MoEOutProj at op level (bench_plugins --only moe_out), against
# the launches it replaced and the weight floor.
source tools/device/env.sh
timeout ${B_S:-120} python3 tools/bench_plugins.py --only moe_out 2>&1 | grep -E '^\{|Error' | tee $OUT/moe_out.jsonl
