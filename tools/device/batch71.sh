# Seventy-first device batch (twenty-third session): batch67's triton_l figures against batch70's (43.8 against
# 48.6 ms at 128 requests): triton_l, triton_p, triton_l again on one machine, then triton_l at 32,128 with 5 reps
# (batch70's arguments).
source tools/device/env.sh
source tools/device/rank_ab.sh
RANK_S=200 RANK_OUT=rank_lane1 rank_ab
RANK_S=200 RANK_OUT=rank_paired MOE_TACTIC=triton_p rank_ab
RANK_S=200 RANK_OUT=rank_lane2 rank_ab
RANK_S=200 RANK_OUT=rank_lane3 BATCHES=32,128 REPS=5 rank_ab
