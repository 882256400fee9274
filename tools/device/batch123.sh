# Hundred-and-twenty-third device batch (forty-third session): bench_plugins' MLA and MoE sections on an H200 (the
# MLA scores' exchange, default since this session, beside the kernel before; the MoE decode's figures again).
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 400 python3 tools/bench_plugins.py --only mla,moe > $OUT/bench.jsonl 2> $OUT/bench.err
tail -3 $OUT/bench.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "bench.jsonl")):
    d = json.loads(line)
    if d.get("bench") in ("mla", "hbm", "mla_check", "mla_config_failed", "moe_decode", "moe_prefill") \
            or (d.get("bench") == "mla_config" and d.get("H") == 96):
        print(json.dumps(d))
PY
