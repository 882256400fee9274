# Ninety-eighth device batch (for the twenty-eighth session; not run yet): the twenty-seventh session's changes after
# its last GPU run. The GPU files that cover them: the engine file (async step on graphs, now also against the same
# step with explicit ids; eager steps uploading through pinned memory), the NCCL graph file (an async step on rank
# 0), the sampler's GPU file (its parameters through upload.to_device) and the pipeline graphs; then the rank in
# three processes with the runtime's loop, sync (now reading each step's ids once) and async.
source tools/device/env.sh
source tools/device/rank_ab.sh
timeout 300 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/dist/test_graphs_nccl_gpu.py \
  tests/runtime/test_sampler_gpu.py tests/runtime/test_pp_graphs_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -15
for i in 1 2 3; do RANK_S=90 RANK_OUT=rank_$i RANK_KEYS="batch step_ms graph_ms loop_ floor_ms hbm" rank_ab; done
