# Hundred-and-fifth device batch (prepared in the thirtieth session; the thirty-first ran it inline at 32 requests
# only, BATCHES=32 RANK_S=150, BENCHMARKS.md): the rank's
# decode step with the MoE decode's per-pair rows in bf16 (bench_rank --ab moe-y-half, MoETactic.y_half) against
# the engine's decode_l, side by side in each process, two processes. Run after batch104.sh shows decode_l_yh's
# check (rel-L2 near decode_l's) and its time at the op level.
source tools/device/env.sh
source tools/device/rank_ab.sh
for i in 1 2; do
  echo "process $i"
  RANK_OUT=rank_yh_$i RANK_S=250 rank_ab moe-y-half
done
