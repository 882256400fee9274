# Hundred-and-first device batch (twenty-eighth session): async scheduling on by default for a GPU engine without
# pipeline stages or attention-DP. The engine file now runs every case on that default (the sync comparison asks
# for sync), plus preemption by recompute and by swap with a step in flight; then the other GPU runtime files.
source tools/device/env.sh
source tools/device/rank_ab.sh
timeout 330 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/dist/test_graphs_nccl_gpu.py \
  tests/runtime -p no:cacheprovider --tb=short -rs > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed|SKIP" $OUT/pytest.txt | tail -25
RANK_S=90 RANK_OUT=rank_1 RANK_KEYS="batch step_ms graph_ms loop_ floor_ms hbm" rank_ab
