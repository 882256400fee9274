# Sixty-first device batch (twenty-second session): the MoE decode's down kernel in its own blocks (128 rows, 8 or 4
# warps; 4 stages) and PDL on every Triton kernel, each against the default in one process (rank A/B at 32 and 128).
source tools/device/env.sh
source tools/device/rank_ab.sh
BATCHES=32,128 RANK_S=540 rank_ab moe-down-bn128 moe-down-bn128-w4 moe-down-stages4 pdl
