# Hundred-and-twenty-fifth device batch (forty-fourth session): the MLA section again with one split's output written
# in place (no partials, no merge) for both kernels; the MLA GPU tests (the "gluon" tactic's mixer at 96 heads);
# the engine GPU tests last (sm90 tiny engines record the "triton" MLA tactic: their 4 heads).
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 200 python3 tools/bench_plugins.py --only mla > $OUT/bench.jsonl 2> $OUT/bench.err
tail -3 $OUT/bench.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "bench.jsonl")):
    d = json.loads(line)
    if d.get("bench") in ("mla", "env", "mla_mma_rate", "mla_config_failed") or (d.get("bench") == "mla_config" and d.get("H") == 96):
        print(json.dumps({k: v for k, v in d.items() if k not in ("kv_bytes", "rel_l2_vs_bmm", "num_stages")}))
PY
timeout 120 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py 2>&1 | tail -2
timeout 150 python3 -m pytest -q -x -m gpu tests/model tests/runtime 2>&1 | tail -3
