# Hundred-and-twenty-second device batch (forty-third session): Nsight Compute on the MLA decode at 96 heads,
# 64 x 8K, the scores' exchange off then on: where a page's ~7K cycles go (stall reasons, per-SASS samples).
source tools/device/env.sh
ARGS="--moe-tokens 0 --kda-sequences 0 --mla-heads 96"
python3 tools/profile_kernels.py $ARGS   # compiles into Triton's cache, outside the profiler
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout ${NCU_S:-240} $NCU --clock-control none -k regex:'mla_decode_kernel' --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SourceCounters -o $OUT/mla -f \
  python3 tools/profile_kernels.py $ARGS > $OUT/ncu_log.txt 2>&1
tail -5 $OUT/ncu_log.txt
if [ -f $OUT/mla.ncu-rep ]; then
  $NCU -i $OUT/mla.ncu-rep --page source --csv --print-source sass > $OUT/source.csv 2>&1
  $NCU -i $OUT/mla.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1
  python3 tools/ncu_summary.py $OUT/raw.csv --source $OUT/source.csv --top 15
fi
