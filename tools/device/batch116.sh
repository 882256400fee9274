# Hundred-and-sixteenth device batch (thirty-ninth session): batch115 reordered to fit one call when the device is
# scarce: the issue's figure first (bench_plugins' MoE section, decode_l_sr among its tactics), then the rank at 32
# requests with and without it (bench_rank --ab moe-scale-regs), then decode_l_sr's GPU tests. sreg_probe.py left
# out (the occupancy diagnostic). H200 only for the timings. Carry fla-core's wheel (.whl).
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ "$card" == *H200* ]]; then
  timeout 230 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' | cut -c1-500
  source tools/device/rank_ab.sh
  BATCHES=32 RANK_S=170 rank_ab moe-scale-regs
fi
timeout 120 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py \
  -k "scale_regs or half_pair or gathering" -p no:cacheprovider --tb=short 2>&1 | tail -2
