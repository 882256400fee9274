# Thirty-fifth device batch (seventeenth session): the rank with the Router forked onto the executor's side stream
# (the default) and without (--one-stream), side by side in one process.
source tools/device/env.sh
timeout ${RANK_S:-300} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} --one-stream \
  2>&1 | grep '^{' | tee $OUT/rank.jsonl | grep -E 'rank_decode' | cut -c1-400
