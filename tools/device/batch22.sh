# Twenty-second device batch (fourteenth session), right after batch21 on the same machine: the rank with the KDA
# decode's split tactic and with its fused tactic, side by side, then split again (the
# thirteenth session saw back-to-back processes differ by up to 1 ms).
source tools/device/env.sh
for t in ${ORDER:-split fused split}; do
  timeout ${RANK_S:-170} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} \
    --kda-decode $t 2>&1 | grep '^{' | tee -a $OUT/rank_$t.jsonl | grep -E 'rank_decode|rank_env' | cut -c1-220
done
