# Eighty-first device batch (twenty-fifth session): where the 32-request step's time goes inside the CUDA graph
# (bench_rank --timeline: kernels grouped by name, the replay's span against its kernels' sum, one layer's
# launches), and the rank's dense GEMMs shape by shape against cuBLAS (--gemms).
source tools/device/env.sh
timeout 150 python3 tools/bench_rank.py --batches 32,128 --reps 5 --timeline 2>&1 | grep '^{' > $OUT/timeline.jsonl
tail -c 300 $OUT/timeline.jsonl
timeout 120 python3 tools/bench_rank.py --gemms --batches 32,128 2>&1 | grep '^{' > $OUT/gemms.jsonl
cat $OUT/gemms.jsonl | cut -c 1-200
