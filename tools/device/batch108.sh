# Hundred-and-eighth device batch (prepared in the thirty-second session; not yet run): the MLA decode with fewer
# splits. At 64 requests x 8K with 16 heads the host splits each sequence 8 ways (num_splits_for, about two waves of
# programs); the partial outputs (fp32, 16.8 MB) are about 3 % of the KV bytes and are read again by the merge
# launch; the two runs that timed it gave 0.87 and 0.78 of the KV floor (goal 0.80; 0.985-1.02 at 32 x 64K).
# 1. bench_plugins' MLA, which now times 2 and 4 splits beside the host's; 2. the rank (6 heads a rank, 16 splits at
# 32 requests) with the splits for about one wave (bench_rank --ab mla-one-wave). Carry fla-core's wheel (.whl).
source tools/device/env.sh
timeout 200 python3 tools/bench_plugins.py --only mla 2>&1 | grep '^{' > $OUT/mla.jsonl
python3 - <<'PY'
import json, os
for r in map(json.loads, open(f"{os.environ['OUT']}/mla.jsonl")):
    if r["bench"] == "mla_config":
        print(r["B"], r["L"], r["H"], r["block_h"], r["num_splits"], r["ms"], r["frac_of_floor"])
    elif r["bench"] == "mla":
        print("best", r["B"], r["L"], r["H"], r["best_config"], r["frac_of_floor"], r["speedup_vs_bmm"])
PY
source tools/device/rank_ab.sh
RANK_S=300 RANK_OUT=rank_mla rank_ab mla-one-wave
