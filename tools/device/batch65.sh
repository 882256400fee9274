# Sixty-fifth device batch (twenty-second session): the whole GPU suite on the session's final code, then the NCCL
# graph tests (TP2 rank and attention-DP rank on a one-process group).
source tools/device/env.sh
timeout 440 python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime -k "not tune" -p no:cacheprovider \
  --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -25
timeout 130 python3 -m pytest -q -m gpu tests/dist/test_graphs_nccl_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest_nccl.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest_nccl.txt | tail -10
