# Eighty-fifth device batch (twenty-fifth session): launch widths of the small AttnRes and top-k launches in the rank,
# one process (--ab: AttnRes chunks of 256, its norm-fused mix in 4 or 16 warps, the top-k launch in 4 warps or
# casting 512 columns a program), then one profiled graph replay at 32 and 128 requests (--timeline).
source tools/device/env.sh
source tools/device/rank_ab.sh
RANK_S=330 RANK_OUT=rank_ab rank_ab attn-res-chunk256 attn-res-mix-warps4 attn-res-mix-warps16 topk-warps4 topk-cast512
timeout 150 python3 tools/bench_rank.py --batches 32,128 --reps 5 --timeline 2>&1 | grep '^{' > $OUT/timeline.jsonl
