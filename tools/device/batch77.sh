# Seventy-seventh device batch (twenty-fourth session): does the list of batch sizes move the rank's step at 128
# requests (43.8-44.9 ms with 32,64,128 against 47.0-48.6 ms with 32,128 in the twenty-third session, whose
# 32,128 runs also took 5 reps)? The same code in three processes on one machine, 10 reps each: 32,128, then
# 32,64,128, then 128 alone.
source tools/device/env.sh
source tools/device/rank_ab.sh
RANK_S=190 RANK_OUT=rank_32_128 BATCHES=32,128 rank_ab
RANK_S=190 RANK_OUT=rank_32_64_128 rank_ab
RANK_S=190 RANK_OUT=rank_128 BATCHES=128 rank_ab
