# Twenty-ninth device batch (sixteenth session): Nsight Compute over one eager decode step of the real-size rank at
# 64 requests, each distinct kernel launch configuration once (--filter-mode per-launch-config), to find kernels
# that, like the fused KDA decode did, wait out memory latencies instead of streaming. It ran out of its 400 s with
# 4 small kernels profiled (the rank's setup is slow under ncu; the torch profiler also sees nothing while ncu is
# attached): give it a longer limit and fewer sections, or profile kernels alone (tools/profile_kernels.py).
source tools/device/env.sh
timeout ${NCU_S:-400} ncu --clock-control none --profile-from-start off --filter-mode per-launch-config \
  --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats \
  --section WarpStateStats --section SourceCounters -o $OUT/step -f \
  python3 tools/bench_rank.py --batches 64 --reps 3 --warmup-s 0.5 --profile --ncu-step > $OUT/rank_log.txt 2>&1
grep -E '^\{' $OUT/rank_log.txt | cut -c1-300 | tail -4
grep -E '==PROF==|rror' $OUT/rank_log.txt | tail -4
if [ -f $OUT/step.ncu-rep ]; then
  ncu -i $OUT/step.ncu-rep --page details --csv > $OUT/details.csv 2>&1
  ncu -i $OUT/step.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1
  ncu -i $OUT/step.ncu-rep --page source --csv --print-source sass > $OUT/source.csv 2>&1
  wc -c $OUT/*.csv
fi
