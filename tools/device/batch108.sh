# Hundred-and-eighth device batch (prepared in the thirty-second session; not yet run): the MLA decode at 16 heads
# with fewer splits. At 64 requests x 8K the host splits each sequence 8 ways (num_splits_for); the partial outputs
# (fp32, 16.8 MB) are about 3 % of the KV bytes and are read again by the merge launch; the two runs that timed it
# gave 0.87 and 0.78 of the KV floor there (goal 0.80; 0.985-1.02 at 32 x 64K). bench_plugins' MLA now times 2 and 4 splits beside the
# host's: two processes, each with its own HBM read for its floor. Carry fla-core's wheel (.whl).
source tools/device/env.sh
for i in 1 2; do
  timeout 200 python3 tools/bench_plugins.py --only mla 2>&1 | grep '^{' > $OUT/mla_$i.jsonl
done
python3 - <<'PY'
import json, os
for i in (1, 2):
    rows = [json.loads(l) for l in open(f"{os.environ['OUT']}/mla_{i}.jsonl")]
    for r in rows:
        if r["bench"] == "mla_config":
            print(i, r["B"], r["L"], r["H"], r["block_h"], r["num_splits"], r["ms"], r["frac_of_floor"])
        elif r["bench"] == "mla":
            print(i, "best", r["B"], r["L"], r["H"], r["best_config"], r["frac_of_floor"], r["speedup_vs_bmm"])
PY
