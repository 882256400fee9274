# Thirty-third device batch (seventeenth session): the rank with the shift-decoded MoE layout and MoEOutProj, then
# one profiled eager step at 64 requests (the kernel groups after the change).
source tools/device/env.sh
timeout ${RANK_S:-230} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} 2>&1 \
  | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode|rank_env' | cut -c1-300
timeout ${PROF_S:-150} python3 tools/bench_rank.py --batches 64 --reps 3 --profile 2>&1 | grep '^{' \
  > $OUT/profile.jsonl; tail -c 300 $OUT/profile.jsonl
