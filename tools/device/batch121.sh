# Hundred-and-twenty-first device batch (forty-third session): MLA decode with the scores exchanged through an L2
# scratch (exchange=True: each warpgroup computes its share of the scores) beside the engine's kernel: its GPU
# tests, then bench_plugins' MLA section. Carry fla-core's wheel.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py -p no:cacheprovider --tb=short -rs \
  > $OUT/pytest_mla.txt 2>&1
grep -E "^E  |passed|failed|^FAILED" $OUT/pytest_mla.txt | tail -12
timeout 300 python3 tools/bench_plugins.py --only mla ${SWEEP:+--sweep} > $OUT/bench_mla.jsonl 2> $OUT/bench_mla.err
tail -3 $OUT/bench_mla.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "bench_mla.jsonl")):
    d = json.loads(line)
    if d.get("bench") in ("mla", "hbm", "mla_check", "mla_config_failed") or d.get("H") == 96:
        print(json.dumps(d))
PY
