# Fourteenth device batch (right after batch13): the rank at 32/64/128 requests with the GLU and top-k changes,
# one profiled eager step at 32, the MoE sweep (paired layout v2) and the KDA sweep. Under 600 s.
source tools/device/env.sh
timeout ${RANK_S:-150} python3 tools/bench_rank.py --batches 32,64,128 --reps 3 2>&1 | grep '^{' \
  | tee $OUT/rank.jsonl
timeout ${PROF_S:-60} python3 tools/bench_rank.py --batches 32 --reps 3 --profile 2>&1 | grep rank_profile \
  > $OUT/profile.jsonl
timeout ${MOE_S:-220} python3 tools/bench_plugins.py --sweep --only moe 2>&1 | grep '^{' | tee $OUT/moe.jsonl \
  | grep -v '"moe_tactic"'
timeout ${KDA_S:-140} python3 tools/bench_plugins.py --sweep --only kda 2>&1 | grep '^{' | tee $OUT/kda.jsonl \
  | grep -v '_config"'
