# Twenty-seventh device batch (sixteenth session), after batch26's ncu profile of the fused KDA decode: its small
# loads (conv windows, gate, out gate) now go out with the state instead of one after another (LOAD_ORDER). The
# decode GPU tests with every load order, the decode sweep (no prefill), then ncu on the new default.
source tools/device/env.sh
timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py -k "decode" -p no:cacheprovider \
  --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
(cd tools/bench && timeout ${KDA_S:-240} python3 -c "
import kda, common, torch
bw = common.hbm_read_tbps()
common.emit(bench='env', device=torch.cuda.get_device_name(), hbm_read_tbps=round(bw, 3))
kda.bench_kda_prefill = lambda *a: None  # decode only
kda.bench_kda(bw, True)
" 2>&1 | grep '^{' > $OUT/kda.jsonl)
grep -E '"kda_decode"' $OUT/kda.jsonl | cut -c1-600
grep -E 'kda_decode_config' $OUT/kda.jsonl | cut -c1-200
timeout ${NCU_S:-150} ncu --clock-control none -k regex:'kda_decode_fused' --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters -o $OUT/kda -f \
  python3 tools/profile_kernels.py --calls 1 --moe-tokens 0 > $OUT/ncu_log.txt 2>&1
tail -3 $OUT/ncu_log.txt
if [ -f $OUT/kda.ncu-rep ]; then
  ncu -i $OUT/kda.ncu-rep --page details --csv > $OUT/details.csv 2>&1
  ncu -i $OUT/kda.ncu-rep --page source --csv --print-source sass > $OUT/source.csv 2>&1
  ncu -i $OUT/kda.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1
  grep -E '"(Duration|Memory Throughput|Warp Cycles Per Issued Instruction|Registers Per Thread)"' $OUT/details.csv | cut -c150-260
fi
