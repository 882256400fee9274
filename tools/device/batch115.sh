# Hundred-and-fifteenth device batch (thirty-seventh session). On any card: decode_l_sr (the lane gate/up kernel's
# scales prefetched into registers, four programs an SM) against decode_l bit for bit, and decode_l_yh's and _gc's
# tests (the three now share their setup). On an H200 only: decode_l and decode_l_sr timed side by side with each
# kernel's occupancy (sreg_probe.py), the rank at 32 requests with and without it in one process (bench_rank --ab
# moe-scale-regs), then bench_plugins' MoE section (decode_l_sr is among its tactics). The probe ran on an H100 in
# the same session: BENCHMARKS.md. Carry fla-core's wheel (.whl).
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 120 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py \
  -k "scale_regs or half_pair or gathering" -p no:cacheprovider --tb=short 2>&1 | tail -2
[[ "$card" == *H200* ]] || exit 0
timeout 150 python3 tools/device/sreg_probe.py 2>&1 | tee $OUT/sreg.jsonl | grep -v occupancy
source tools/device/rank_ab.sh
BATCHES=32 RANK_S=170 rank_ab moe-scale-regs
timeout 240 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' | cut -c1-500
