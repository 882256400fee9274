# Hundred-and-sixty-third device batch (fifty-seventh session): batch162 less its Gluon GPU tests (they passed on an
# H100 this session: BENCHMARKS.md, pytest -m gpu), plus the 96-head MLA decode bench after the descriptor cache. On
# an H200 only (needs_h200: the rank's 96.8 GiB do not fit an H100). 1. the MoE decode bench with decode_l_pf (never
# on an H200); 2. the rank at 32 requests with the prefetch's A/B; 3. the MLA bench's quick rows (last: cut first).
# Carry .whl. About 400 s.
source tools/device/env.sh
source tools/device/rank_ab.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 110 python3 tools/bench_plugins.py --only moe > $OUT/moe.jsonl 2>&1
grep -E '"bench": "(moe|env)"' $OUT/moe.jsonl | cut -c1-300
BATCHES=32 RANK_S=170 RANK_OUT=rank_ab rank_ab moe-no-prefetch
K3_BENCH_MLA_QUICK=1 timeout 100 python3 tools/bench_plugins.py --only mla > $OUT/mla.jsonl 2>&1
grep -E '"bench": "mla"' $OUT/mla.jsonl | cut -c1-300
