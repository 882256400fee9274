# Hundred-and-sixty-second device batch (fifty-sixth session): what is pending on an H200, in one call, most
# needed first, for a session that gets one H200 call (run with needs_h200: the rank's 96.8 GiB do not fit an H100).
# 1. batch161: the Gluon MLA GPU tests after the TMA descriptor cache (never run on a GPU; 64/96/128 heads, ragged,
#    splits) and the 96-head mixer; 2. the MoE decode bench with decode_l_pf (never on an H200); 3. the rank at 32
#    requests with the prefetch's A/B. Carry .whl. About 500 s.
source tools/device/env.sh
source tools/device/rank_ab.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 200 python3 -m pytest -q -x -m gpu tests/plugins/test_mla_gpu.py -rf -p no:cacheprovider \
  -k "gluon_mla_decode_matches_definition or mixer_matches_reference" 2>&1 | tail -4 | tee $OUT/tests.txt
timeout 110 python3 tools/bench_plugins.py --only moe > $OUT/moe.jsonl 2>&1
grep -E '"bench": "(moe|env)"' $OUT/moe.jsonl | cut -c1-300
BATCHES=32 RANK_S=170 RANK_OUT=rank_ab rank_ab moe-no-prefetch
