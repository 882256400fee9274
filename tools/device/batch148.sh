# Hundred-and-forty-eighth device batch (fifty-first session): on an H200 only, the MoE section of bench_plugins (the
# engine's decode_l_pf at 1-8 tokens an expert; the H200's last figure at 8 was 0.786 of the floor, decode_l_yh,
# before the prefetch); on another card it prints the card and stops, so that asking for an H200 costs little.
# Carry .whl.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
[[ "$card" == *H200* ]] || exit 0
source tools/device/env.sh
K3_PDL=0 timeout 240 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' \
  | cut -c1-400
