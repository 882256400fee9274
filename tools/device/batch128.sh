# Hundred-and-twenty-eighth device batch (forty-fifth session): the warp-specialized Gluon MLA decode ("gluon_ws":
# a scores warpgroup, a values warpgroup, a loader warp). Its GPU tests first (against the fp64 definition and the
# Triton kernel; a hang in its barriers would show as the timeout), then the MLA bench (gluon and gluon_ws side by
# side at 96 heads, with the run's MMA rate and each case's math floor), then Nsight Compute on the warp-specialized
# kernel at 64 x 8K if time is left. Ran on c6aeffc; since 000801a that kernel is "gluon", the only Gluon kernel
# (to run this again, read gluon for gluon_ws).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 150 python3 -m pytest -q -x -m gpu tests/plugins/test_mla_gpu.py -k "gluon" > $OUT/tests.txt 2>&1
rc=$?
tail -3 $OUT/tests.txt
if [ $rc -ne 0 ]; then grep -m3 -B2 -A12 "Error\|assert" $OUT/tests.txt | cut -c1-200; exit 1; fi
timeout 200 python3 tools/bench_plugins.py --only mla > $OUT/bench.jsonl 2> $OUT/bench.err
tail -2 $OUT/bench.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "bench.jsonl")):
    d = json.loads(line)
    if d.get("bench") in ("mla", "env", "mla_mma_rate", "mla_config_failed") or (
            d.get("bench") == "mla_config" and d.get("H") == 96 and d.get("kernel") != "triton"):
        print(json.dumps({k: v for k, v in d.items() if k not in ("kv_bytes", "rel_l2_vs_bmm", "num_stages")}))
PY
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for k in gluon_ws; do
  ARGS="--moe-tokens 0 --kda-sequences 0 --mla-heads 96 --mla-kernel $k"
  python3 tools/profile_kernels.py $ARGS > /dev/null 2>&1
  timeout 100 $NCU --clock-control none -k regex:'mla_decode_sm90' --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis -o $OUT/$k -f \
    python3 tools/profile_kernels.py $ARGS > $OUT/ncu_$k.txt 2>&1
  [ -f $OUT/$k.ncu-rep ] && $NCU -i $OUT/$k.ncu-rep --page details --csv > $OUT/details_$k.csv 2>&1 && \
    grep -E "\"Duration\"|DRAM Throughput|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Shared" \
      $OUT/details_$k.csv | cut -c1-220 | head -12
done
