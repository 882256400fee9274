# Fifteenth device batch (after batch13 and batch14): the rank with every dense GEMM of <= 64 rows through the
# experimental skinny Triton GEMM, against batch14's torch figures. Under 200 s.
source tools/device/env.sh
timeout ${RANK_S:-150} python3 tools/bench_rank.py --batches 32,64 --reps 3 --skinny 2>&1 | grep '^{' \
  | tee $OUT/rank_skinny.jsonl
