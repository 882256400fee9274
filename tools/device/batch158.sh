# Hundred-and-fifty-eighth device batch (fifty-fourth session), on an H200 only (the rank's 96.8 GiB of weights do
# not fit an H100): the MoE decode with decode_l_pf (never measured on an H200), then the rank at 32 requests with
# the prefetch's A/B. Carry .whl. About 280 s.
source tools/device/env.sh
source tools/device/rank_ab.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 120 python3 tools/bench_plugins.py --only moe > $OUT/moe.jsonl 2>&1
grep -E '"bench": "(moe|env)"' $OUT/moe.jsonl | cut -c1-300
BATCHES=32 RANK_S=170 RANK_OUT=rank_ab rank_ab moe-no-prefetch
