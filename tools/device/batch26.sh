# Twenty-sixth device batch (sixteenth session): the KDA and engine GPU tests after batch25's unrolled conv (which
# had only one of them), then Nsight Compute on the decode kernels that hold the rank, where the machine's runtime
# lets ncu read counters (Firecracker; on gVisor it cannot): stall reasons and per-SASS-instruction samples.
source tools/device/env.sh
uname -r
timeout ${TEST_S:-240} python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
python3 tools/profile_kernels.py   # compiles into Triton's cache, outside the profiler
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout ${NCU_S:-200} $NCU --clock-control none -k regex:'moe_gate_up|moe_down|kda_decode_fused' --launch-count 3 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SourceCounters -o $OUT/decode -f \
  python3 tools/profile_kernels.py > $OUT/ncu_log.txt 2>&1
tail -5 $OUT/ncu_log.txt
if [ -f $OUT/decode.ncu-rep ]; then
  $NCU -i $OUT/decode.ncu-rep --page details --csv > $OUT/details.csv 2>&1
  $NCU -i $OUT/decode.ncu-rep --page source --csv --print-source sass > $OUT/source.csv 2>&1
  $NCU -i $OUT/decode.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1
  wc -c $OUT/*.csv
  grep -E '"(Warp Cycles Per Issued Instruction|Issued Warp Per Scheduler|No Eligible|Achieved Occupancy|Registers Per Thread|Duration|Memory Throughput|Stall [A-Za-z ]+)"' $OUT/details.csv | cut -c1-200 | head -60
fi
