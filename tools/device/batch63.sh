# Sixty-third device batch (twenty-second session): where the MoE decode's fixed cost goes (moe_tail_probe.py:
# touched experts first, spread, or alone in the grid; each call's kernel timeline).
source tools/device/env.sh
timeout 200 python3 tools/device/moe_tail_probe.py 2>&1 | grep '^{' | tee $OUT/moe_tail.jsonl
