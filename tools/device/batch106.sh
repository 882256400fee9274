# Run in the thirty-third session on an H100 (BENCHMARKS.md, bench_plugins: the tiles pay, the gathering combine
# does not). Hundred-and-sixth device batch (prepared in the thirty-second session, which had no device): the MoE
# decode's two small launches around its GEMMs. At 8 tokens an expert decode_l is 1-2 % short of 0.80 of the weight
# floor, and the twenty-fourth session's timeline put 6.5 µs of its 8.9 µs over the 1-token case in the pair sort
# (6.4 against 2.2 µs) and the combine (5.0 against 2.7 µs). Two changes aim at them:
# - the sort on [BLOCK/4, 4] tiles (SORT_COLS 4): the same output in about a third fewer static sm_90 instructions
#   than a flat scan at blocks of 512 and 8192 pairs (compiled on a CPU); whether that is time is what this asks;
# - decode_l_gc (MoETactic.gather_combine): the combine loads a token's 16 sorted positions at once and gathers its
#   local rows together; the loop's sm_90 code (compiled on a CPU) loads each position only after the previous
#   row's add, 16 rounds of a position load and then its row load.
# This batch: their GPU tests; the sort alone against the flat scan (moe_sort_probe); each launch's timeline in the
# MoE call for both changes (moe_fixed_probe). batch107.sh, in a call of its own: bench_plugins' MoE and the rank.
# Carry fla-core's wheel (.whl).
source tools/device/env.sh
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/plugins/test_norm_gpu.py \
  -k 'moe or sort or gathering' -x 2>&1 | tail -3
timeout 150 python3 tools/device/moe_sort_probe.py 2>&1 | grep '^{' | tee $OUT/sort.jsonl
timeout 230 python3 tools/device/moe_fixed_probe.py 2>&1 | grep '^{' > $OUT/fixed.jsonl
python3 -c "import json
for l in open('$OUT/fixed.jsonl'):
    d = json.loads(l)
    if d['bench'] == 'moe_fixed':
        print(d['tactic'], d['sort_cols'], d['touched'], d['tpe'], d['ms'], d['of_floor'], d['timeline'][0],
              d['timeline'][-1])"
