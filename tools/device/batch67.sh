# Sixty-seventh device batch (twenty-third session): the rank with the lane MoE layout (triton_l, the new default),
# then with triton_p (the previous default) on the same machine, at 32, 64 and 128 requests.
source tools/device/env.sh
source tools/device/rank_ab.sh
RANK_S=280 RANK_OUT=rank_lane rank_ab
RANK_S=280 RANK_OUT=rank_paired MOE_TACTIC=triton_p rank_ab
