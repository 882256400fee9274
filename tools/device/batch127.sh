# Hundred-and-twenty-seventh device batch (forty-fifth session): decode_l_ac, the MoE combine launched beside the
# down kernel with each token awaiting its own experts (a count an expert): its GPU test (bit for bit decode_l's,
# eager and over CUDA-graph replays), then the fixed-cost probe's timeline of decode_l and decode_l_ac side by side
# (at 56 x 8 the combine took 5.0-5.5 us after the down kernel), then bench_plugins' MoE decode figures. Ran on
# b830f4f without the last part (the device budget); decode_l_ac was level with decode_l and removed after (BENCHMARKS).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 120 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "awaiting or gathering or half" 2>&1 | tail -2
timeout 150 python3 tools/device/moe_fixed_probe.py --variants decode_l,decode_l_ac > $OUT/fixed.jsonl 2> $OUT/fixed.err
tail -2 $OUT/fixed.err
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "fixed.jsonl")):
    d = json.loads(line)
    if d["bench"] == "moe_fixed":
        tl = d["timeline"]
        print(d["tactic"], d["touched"], "x", d["tpe"], d["ms"], d["of_floor"], "down", tl[-2][1:], "combine", tl[-1][1:])
    else:
        print(line.strip())
PY
timeout 200 python3 tools/bench_plugins.py --only moe > $OUT/moe.jsonl 2> $OUT/moe.err
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.path.join(os.environ["OUT"], "moe.jsonl"))]
print([r for r in rows if r["bench"] == "env"])
for tactic in ("decode_l", "decode_l_ac", "decode_l_yh"):
    frac = {r["tokens_per_expert"]: r["frac_of_floor"] for r in rows if r.get("tactic") == tactic and r["bench"] == "moe_tactic"}
    print(tactic, "/ floor at 1/2/4/8:", [frac.get(t) for t in (1, 2, 4, 8)])
print([{k: r[k] for k in ("tactic", "rel_l2")} for r in rows if r["bench"] == "moe_check" and r["tactic"].startswith("decode_l")])
PY
