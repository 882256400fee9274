# Fifty-third device batch (twentieth session): a multi-rank engine's decode graphs with NCCL inside (rank 0 of a
# TP2 engine on a one-process NCCL group), and the single-rank graph tests after rank_runner's graph_blocker.
source tools/device/env.sh
timeout ${TEST_S:-330} python3 -m pytest -q -m gpu tests/dist/test_graphs_nccl_gpu.py tests/model/test_gpu_engine.py \
  -k "nccl or graph or sync" -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -30
