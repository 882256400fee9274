# Hundred-and-thirty-first device batch (forty-sixth session), two variants of the Gluon MLA decode, both off:
# LEAN_SOFTMAX (no mask on the pages inside the context, the scale folded into the exponent's FFMA) and
# batch130's NARROW_REMAINDER (96 heads' last 32 on the MMA's N; now one launch with the 64-row blocks). The GPU
# tests of both (the default kernel is unchanged: 183 passed in batch128), then the MLA bench with "gluon",
# "gluon_lean" and "gluon_narrow" side by side, and its prefill case.
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
# QUICK=1 (little device time left): the bench alone, its 96-head cases' Gluon rows (each with its error against
# bmm) beside the floors and bmm
if [ -z "$QUICK" ]; then
  timeout 200 python3 -m pytest -q -x -m gpu tests/plugins/test_mla_gpu.py -k "lean or narrow or 256_wide or mixer" \
    > $OUT/tests.txt 2>&1
  rc=$?
  tail -3 $OUT/tests.txt
  if [ $rc -ne 0 ]; then grep -m3 -B2 -A12 "Error\|assert" $OUT/tests.txt | cut -c1-200; exit 1; fi
fi
K3_BENCH_MLA_QUICK=$QUICK timeout 300 python3 tools/bench_plugins.py --only mla > $OUT/bench.jsonl 2> $OUT/bench.err
tail -2 $OUT/bench.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "bench.jsonl")):
    d = json.loads(line)
    if d.get("bench") in ("mla", "env", "mla_mma_rate", "mla_config_failed", "mla_check", "mla_prefill") or (
            d.get("bench") == "mla_config" and d.get("H") == 96 and d.get("kernel") != "triton"):
        print(json.dumps({k: v for k, v in d.items() if k not in ("kv_bytes", "num_stages")}))
PY
