# Hundred-and-forty-seventh device batch (fifty-first session): batch146's bench part again, its prefill inputs
# made a state a sequence (batch146's bench_kda_prefill made a state a token, 48 GiB, and ran out of memory on an
# H100): bench_plugins' KDA prefill section with the kda_prefill_layout rows. Carry .whl.
source tools/device/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 300 python3 tools/bench_plugins.py --only kda_prefill 2>&1 | tee $OUT/kda_prefill.jsonl | cut -c1-600
