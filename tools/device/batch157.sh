# Hundred-and-fifty-seventh device batch (fifty-fourth session), for an H200: the MoE decode with decode_l_pf (never
# measured on an H200), then the rank at 32 requests on today's code (MLA prefill forms, decode_l_pf) with the
# prefetch's A/B. Carry .whl. About 370 s.
source tools/device/env.sh
source tools/device/rank_ab.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
K3_PDL=0 timeout 200 python3 tools/bench_plugins.py --only moe > $OUT/moe.jsonl 2>&1
grep -E '"bench": "(moe|env)"' $OUT/moe.jsonl | cut -c1-300
BATCHES=32 RANK_S=170 RANK_OUT=rank_ab rank_ab moe-no-prefetch
