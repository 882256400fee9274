# Hundred-and-fifteenth device batch (thirty-seventh session), for an H200 (exits on another card): the lane
# gate/up kernel's scales in registers (SREG, four programs an SM) against the pipeline's shared buffers
# (sreg_probe.py), then bench_plugins' MoE section. Run on an H100 the same session: BENCHMARKS.md. Carry .whl.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
[[ "$card" == *H200* ]] || exit 0
timeout 150 python3 tools/device/sreg_probe.py 2>&1 | tee $OUT/sreg.jsonl | grep -v occupancy
timeout 200 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | tail -4 | cut -c1-600
