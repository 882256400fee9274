# Hundred-and-sixth device batch (prepared in the thirty-second session, which had no device; not yet run): the MoE
# decode's two small launches around its GEMMs. At 8 tokens an expert decode_l is 1-2 % short of 0.80 of the weight
# floor, and the twenty-fourth session's timeline put 6.5 µs of its 8.9 µs over the 1-token case in the pair sort
# (6.4 against 2.2 µs) and the combine (5.0 against 2.7 µs). Two changes aim at them:
# - the sort on [BLOCK/4, 4] tiles (SORT_COLS 4): the same output in a third fewer sm_90 instructions at blocks of
#   512 to 8192 pairs (tools/sass_loops.py); at 8192 pairs one program a SM issues a long straight run of them;
# - decode_l_gc (MoETactic.gather_combine): the combine loads a token's 16 sorted positions at once and gathers its
#   local rows together, instead of 16 rounds of a position load and the dependent row load.
# Steps: 1. their GPU tests; 2. the sort alone against the flat scan (moe_sort_probe), and each launch's timeline
# in the MoE call for both changes (moe_fixed_probe); 3. bench_plugins' MoE in two processes (decode_l and
# decode_l_gc side by side, the sort change in both); 4. the rank A/B of both at 32 / 64 / 128 requests.
# Carry fla-core's wheel (.whl).
source tools/device/env.sh
timeout 280 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -x 2>&1 | tail -3
timeout 60 python3 tools/device/moe_sort_probe.py 2>&1 | grep '^{' | tee $OUT/sort.jsonl
timeout 120 python3 tools/device/moe_fixed_probe.py 2>&1 | grep '^{' > $OUT/fixed.jsonl
python3 -c "import json
for l in open('$OUT/fixed.jsonl'):
    d = json.loads(l)
    if d['bench'] == 'moe_fixed':
        print(d['tactic'], d['sort_cols'], d['touched'], d['tpe'], d['ms'], d['of_floor'], d['timeline'][0], d['timeline'][-1])"
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
