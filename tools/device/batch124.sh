# Hundred-and-twenty-fourth device batch (forty-fourth session): the sm_90 Gluon MLA decode kernel
# (plugins/mla/gluon_sm90.py) and the Triton one against their definition, then bench_plugins' MLA section with it beside the Triton one.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 240 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py 2>&1 | tail -15
timeout 300 python3 tools/bench_plugins.py --only mla > $OUT/bench.jsonl 2> $OUT/bench.err
tail -3 $OUT/bench.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "bench.jsonl")):
    d = json.loads(line)
    if d.get("bench") in ("mla", "hbm", "mla_check", "mla_config_failed") \
            or (d.get("bench") == "mla_config" and d.get("H") == 96):
        print(json.dumps(d))
PY
