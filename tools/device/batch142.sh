# Hundred-and-forty-second device batch (written in the forty-ninth session for the next H200; not yet run): the
# issue's H200 figures with this session's changes, most wanted first. bench_plugins' MoE section (the engine's
# decode_l_pf among the tactics: was 0.786 of the floor at 8 tokens an expert), the rank at 32 requests with and
# without the MoE prefetch (bench_rank --ab moe-no-prefetch), the MLA prefill rows (un-absorbed against absorbed,
# with chunks under MIN_NEW_TOKENS to place the threshold).
# On another card it runs the prefill rows only. Carry fla-core's wheel (.whl).
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ "$card" == *H200* ]]; then
  K3_PDL=0 timeout 200 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' \
    | cut -c1-500
  source tools/device/rank_ab.sh
  BATCHES=32 RANK_S=170 rank_ab moe-no-prefetch
fi
timeout 120 python3 tools/device/mla_prefill_rows.py 2>&1 | tee $OUT/mla_prefill.jsonl | cut -c1-700
