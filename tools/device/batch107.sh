# Hundred-and-seventh device batch (prepared in the thirty-second session; not yet run): after batch106.sh, in its own
# call. bench_plugins' MoE in two processes (decode_l and decode_l_gc side by side, the sort on tiles of SORT_COLS
# in both; each process measures its own HBM read for its floor), then the rank's A/B of both changes at 32 / 64 /
# 128 requests (bench_rank --ab moe-gather-combine --ab moe-sort-flat, one process). Carry fla-core's wheel (.whl).
source tools/device/env.sh
for i in 1 2; do
  timeout 170 python3 tools/bench_plugins.py --only moe 2>&1 | grep '^{' > $OUT/moe_$i.jsonl
done
python3 - <<'PY'
import json, os
for i in (1, 2):
    rows = [json.loads(l) for l in open(f"{os.environ['OUT']}/moe_{i}.jsonl")]
    hbm = next((r["hbm_read_tbps"] for r in rows if r["bench"] == "env"), None)
    checks = {r["tactic"]: r["rel_l2"] for r in rows if r["bench"] == "moe_check"}
    print(f"process {i}: HBM {hbm} TB/s; rel-L2 decode_l {checks.get('decode_l')}, decode_l_gc "
          f"{checks.get('decode_l_gc')}")
    for tactic in ("decode_l", "decode_l_gc", "decode_l_yh"):
        frac = {r["tokens_per_expert"]: r["frac_of_floor"] for r in rows
                if r["bench"] == "moe_tactic" and r["tactic"] == tactic}
        print(f"  {tactic} / floor at 1/2/4/8: {[frac.get(t) for t in (1, 2, 4, 8)]}")
PY
source tools/device/rank_ab.sh
RANK_S=240 RANK_OUT=rank_glue rank_ab moe-gather-combine moe-sort-flat
