# Hundred-and-fourth device batch (prepared in the twenty-ninth session; run in the thirty-first, BENCHMARKS.md): the
# MoE decode over three processes. decode_l's 8-token figure (0.793 of the weight floor, goal 0.80) sat 0.9 % under
# the goal in one process, so this batch measures how far it moves from run to run before anyone tunes against it.
# Each process also times decode_l_yh beside it (decode_l with each pair's row y in bf16, thirtieth session): the
# bytes decode_l moves besides the weights are about what it is short of the floor at 8 tokens an expert.
# Each process measures its own HBM read, so its floor is its own. Run after batch103.sh, in its own call.
source tools/device/env.sh
for i in 1 2 3; do
  timeout 170 python3 tools/bench_plugins.py --only moe 2>&1 | grep '^{' > $OUT/moe_$i.jsonl
done
python3 - <<'PY'
import json, os
for i in (1, 2, 3):
    rows = [json.loads(l) for l in open(f"{os.environ['OUT']}/moe_{i}.jsonl")]
    hbm = next((r["hbm_read_tbps"] for r in rows if r["bench"] == "env"), None)
    checks = {r["tactic"]: r["rel_l2"] for r in rows if r["bench"] == "moe_check"}
    print(f"process {i}: HBM {hbm} TB/s; rel-L2 decode_l {checks.get('decode_l')}, decode_l_yh "
          f"{checks.get('decode_l_yh')}")
    for tactic in ("decode_l", "decode_l_yh"):
        frac = {r["tokens_per_expert"]: r["frac_of_floor"] for r in rows
                if r["bench"] == "moe_tactic" and r["tactic"] == tactic}
        print(f"  {tactic} / floor at 1/2/4/8: {[frac.get(t) for t in (1, 2, 4, 8)]}")
    best = {r["tokens_per_expert"]: (r["best_tactic"], r["frac_of_floor"], r["tflops"]) for r in rows
            if r["bench"] == "moe"}
    print(f"  best at 8: {best.get(8)}; best at 128: {best.get(128)}")
PY
