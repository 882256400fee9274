# Ninety-ninth device batch (twenty-eighth session): batch98's GPU files (the twenty-seventh session's changes
# after its last GPU run) plus the graphs uploading only their bucket's page-table rows (`DecodeGraphs._upload`,
# and its new case in the engine file); then the rank in two processes with the runtime's loop, sync and async.
source tools/device/env.sh
source tools/device/rank_ab.sh
timeout 300 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/dist/test_graphs_nccl_gpu.py \
  tests/runtime/test_sampler_gpu.py tests/runtime/test_pp_graphs_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -15
for i in 1 2; do RANK_S=90 RANK_OUT=rank_$i RANK_KEYS="batch step_ms graph_ms loop_ floor_ms hbm" rank_ab; done
