# Hundredth device batch (twenty-eighth session): the MoE decode's blocks on the lane layout at 1-8 tokens an
# expert (bench_plugins' sweep now holds decode_l with wider programs, other warps and stages, and other down
# blocks), beside the engine's tactics and bf16 grouped_mm; the prefill sweep after them.
source tools/device/env.sh
timeout 420 python3 tools/bench_plugins.py --only moe --sweep 2>&1 | grep '^{' > $OUT/moe_sweep.jsonl
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/moe_sweep.jsonl"):
    d = json.loads(l)
    if d["bench"] == "moe_tactic" and d["tokens_per_expert"] < 64 and ("lane" in d["tactic"] or d["tactic"] in ("decode_l", "decode_p")):
        print(d["tokens_per_expert"], d["tactic"], d["ms"], d["frac_of_floor"])
    elif d["bench"] in ("moe", "hbm", "moe_config_failed") or (d["bench"] == "moe_tactic" and d["tokens_per_expert"] >= 64 and d["tflops"] > 290):
        print({k: v for k, v in d.items() if k in ("bench", "tokens_per_expert", "tactic", "floor_ms", "best_tactic", "best_ms", "frac_of_floor", "tflops", "hbm_tbps", "grouped_mm_bf16_ms", "error", "ms")})
PY
