# Hundred-and-twenty-sixth device batch (forty-fourth session): Nsight Compute on the Gluon MLA decode kernel at
# 96 heads, 64 x 8K (tensor pipe, shared-memory and DRAM throughput, stall reasons, per-SASS samples).
source tools/device/env.sh
ARGS="--moe-tokens 0 --kda-sequences 0 --mla-heads 96 --mla-kernel gluon"
python3 tools/profile_kernels.py $ARGS   # compiles into Triton's cache, outside the profiler
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 240 $NCU --clock-control none -k regex:'mla_decode_sm90_kernel' --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SourceCounters -o $OUT/mla -f \
  python3 tools/profile_kernels.py $ARGS > $OUT/ncu_log.txt 2>&1
tail -3 $OUT/ncu_log.txt
if [ -f $OUT/mla.ncu-rep ]; then
  $NCU -i $OUT/mla.ncu-rep --page source --csv --print-source sass > $OUT/source.csv 2>&1
  $NCU -i $OUT/mla.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1
  $NCU -i $OUT/mla.ncu-rep --page details --csv > $OUT/details.csv 2>&1
  python3 tools/ncu_summary.py $OUT/raw.csv --source $OUT/source.csv --top 15
  grep -E "Tensor|Shared|DRAM Throughput|Memory Throughput|Compute \(SM\)|Duration|L2 Hit|L1/TEX Hit" $OUT/details.csv | head -30
fi
