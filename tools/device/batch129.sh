# Hundred-and-twenty-ninth device batch (forty-fifth session): the warp-specialized Gluon MLA decode with one value
# warpgroup beside the scores warpgroup (the engine's, as batch128 measured it, now the only Gluon kernel) and with
# two (gluon_sm90.VALUE_WARPGROUPS = 2: the scores warpgroup on the scores alone). GPU tests of both first, then the
# MLA bench side by side ("gluon" / "gluon_vw2"). Ran on 5be7bbf; two value warpgroups were 3-4 % slower and
# removed after (BENCHMARKS.md).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 150 python3 -m pytest -q -x -m gpu tests/plugins/test_mla_gpu.py -k "two_value_wgs or mixer" > $OUT/tests.txt 2>&1
rc=$?
tail -3 $OUT/tests.txt
if [ $rc -ne 0 ]; then grep -m3 -B2 -A12 "Error\|assert" $OUT/tests.txt | cut -c1-200; exit 1; fi
timeout 240 python3 tools/bench_plugins.py --only mla > $OUT/bench.jsonl 2> $OUT/bench.err
tail -2 $OUT/bench.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "bench.jsonl")):
    d = json.loads(line)
    if d.get("bench") in ("mla", "env", "mla_mma_rate", "mla_config_failed", "mla_check") or (
            d.get("bench") == "mla_config" and d.get("H") == 96 and d.get("kernel") != "triton"):
        print(json.dumps({k: v for k, v in d.items() if k not in ("kv_bytes", "rel_l2_vs_bmm", "num_stages")}))
PY
