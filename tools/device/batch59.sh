# Fifty-ninth device batch (twenty-second session): one profiled eager step of the rank at 32 and 128 requests,
# every kernel (name, ms, launches), to pick the launches still worth fusing.
source tools/device/env.sh
timeout 400 python3 tools/bench_rank.py --batches 32,128 --reps 5 --profile 2>&1 | grep '^{' > $OUT/rank_profile.jsonl
python3 tools/device/print_profile.py $OUT/rank_profile.jsonl
