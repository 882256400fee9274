# Fifty-first device batch (twentieth session): weights asked into L2 from a third stream in the windows between
# heavy nodes (runtime/l2_plan.py, k3plugins/l2_prefetch.py): its GPU test and the forked-router/graph tests beside
# it, then the rank A/B: off, 6 MB and 24 MB a window against the default 12. Ran at 69d5fdf; the prefetch was
# then removed (under 1 % a step), so this script needs that commit.
source tools/device/env.sh
source tools/device/rank_ab.sh
timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -k "l2_prefetch or forked or graph or sync" \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
RANK_S=${RANK_S:-420} rank_ab no-l2-prefetch l2-prefetch-6mb l2-prefetch-24mb
