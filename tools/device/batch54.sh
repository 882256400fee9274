# Fifty-fourth device batch (twenty-first session): the NCCL graph test in its final form (rank 0's wait, replay
# through RankRunner.run), then the whole GPU suite of plugins, model and runtime on the twentieth session's code.
source tools/device/env.sh
timeout 120 python3 -m pytest -q -m gpu tests/dist/test_graphs_nccl_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest_nccl.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest_nccl.txt | tail -20
timeout ${TEST_S:-420} python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime -k "not tune" \
  -p no:cacheprovider --tb=short > $OUT/pytest_all.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest_all.txt | tail -30
