# Fifteenth device batch (after batch13 and batch14): the threaded weight reader against the disk/PCIe floor, the
# rank's dense GEMMs shape by shape (cuBLAS against the experimental skinny Triton GEMM and the floor), then the
# rank with every dense GEMM of <= 64 rows through it, against batch14's torch figures. Under 500 s.
source tools/device/env.sh
for cache in "" "--warm"; do
  timeout ${LOAD_S:-80} python3 tools/bench_load.py --device cuda --gib 8 --repeat 3 $cache 2>&1 | grep '^{' \
    | tee -a $OUT/load.jsonl
done
timeout ${GEMM_S:-120} python3 tools/bench_rank.py --gemms --batches 32,64 2>&1 | grep '^{' | tee $OUT/gemms.jsonl \
  | grep -v '"rank_gemm"'
timeout ${RANK_S:-150} python3 tools/bench_rank.py --batches 32,64 --reps 3 --skinny 2>&1 | grep '^{' \
  | tee $OUT/rank_skinny.jsonl
