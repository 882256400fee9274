# Source after env.sh. rank_ab SWITCH...: bench_rank at $BATCHES (default 32,64,128) with each --ab switch, in one
# process (RANK_S seconds at most); JSON lines to $OUT/${RANK_OUT:-rank}.jsonl (all its output, errors too, to
# .log), the step times printed (RANK_KEYS: the key prefixes printed, space-separated); MOE_TACTIC: bench_rank's
# --moe-tactic.
rank_ab() {
  local ab=()
  for s in "$@"; do ab+=(--ab "$s"); done
  [ -n "$MOE_TACTIC" ] && ab+=(--moe-tactic "$MOE_TACTIC")
  timeout ${RANK_S:-300} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps ${REPS:-10} "${ab[@]}" \
    2>&1 | tee $OUT/${RANK_OUT:-rank}.log | grep '^{' | tee $OUT/${RANK_OUT:-rank}.jsonl | grep -E 'rank_decode|rank_env' | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k: v for k, v in d.items() if k.startswith(tuple('${RANK_KEYS:-step batch floor_ms hbm tokens}'.split()))})"
}
