# Fifty-eighth device batch (twenty-first session): the session's final code (MoEInProj, the review's fixes): the
# whole GPU suite of plugins, model and runtime, and the NCCL graph test.
source tools/device/env.sh
timeout 430 python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime -k "not tune" -p no:cacheprovider \
  --tb=short > $OUT/pytest_all.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest_all.txt | tail -30
timeout 60 python3 -m pytest -q -m gpu tests/dist/test_graphs_nccl_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest_nccl.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest_nccl.txt | tail -10
