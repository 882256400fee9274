# Hundred-and-thirtieth device batch (forty-fifth session; not yet run): the Gluon MLA decode's last head block on
# the MMA's N (gluon_sm90.NARROW_REMAINDER: 96 heads = a 64-row block + 32 heads transposed, no padding heads). Its
# GPU tests (against the fp64 definition and the 64-row form; both kernels on a 256-wide latent too), then the
# MLA bench with "gluon" and "gluon_narrow" side by side. If it is faster, set NARROW_REMAINDER = True (the
# engine's "gluon" tactic then takes it).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 150 python3 -m pytest -q -x -m gpu tests/plugins/test_mla_gpu.py -k "narrow or mixer or 256_wide" > $OUT/tests.txt 2>&1
rc=$?
tail -3 $OUT/tests.txt
if [ $rc -ne 0 ]; then grep -m3 -B2 -A12 "Error\|assert" $OUT/tests.txt | cut -c1-200; exit 1; fi
timeout 240 python3 tools/bench_plugins.py --only mla > $OUT/bench.jsonl 2> $OUT/bench.err
tail -2 $OUT/bench.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "bench.jsonl")):
    d = json.loads(line)
    if d.get("bench") in ("mla", "env", "mla_mma_rate", "mla_config_failed", "mla_check", "mla_prefill") or (
            d.get("bench") == "mla_config" and d.get("H") == 96 and d.get("kernel") != "triton"):
        print(json.dumps({k: v for k, v in d.items() if k not in ("kv_bytes", "rel_l2_vs_bmm", "num_stages")}))
PY
