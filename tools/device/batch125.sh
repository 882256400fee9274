# Hundred-and-twenty-fifth device batch (forty-fourth session): the MLA section again with one split's output written
# in place (no partials, no merge) for both kernels, then Nsight Compute on the Gluon kernel at 96 heads, 64 x 8K.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 60 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py -k "gluon and (1 or 64)" 2>&1 | tail -2
timeout 200 python3 tools/bench_plugins.py --only mla > $OUT/bench.jsonl 2> $OUT/bench.err
tail -3 $OUT/bench.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "bench.jsonl")):
    d = json.loads(line)
    if d.get("bench") in ("mla", "hbm", "mla_config_failed") or (d.get("bench") == "mla_config" and d.get("H") == 96):
        print(json.dumps({k: v for k, v in d.items() if k not in ("kv_bytes", "rel_l2_vs_bmm", "num_stages")}))
PY
ARGS="--moe-tokens 0 --kda-sequences 0 --mla-heads 96 --mla-kernel gluon"
python3 tools/profile_kernels.py $ARGS
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 200 $NCU --clock-control none -k regex:'mla_decode_sm90_kernel' --launch-count 1 \
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
fi
