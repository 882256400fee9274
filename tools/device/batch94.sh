# Ninety-fourth device batch (for the twenty-seventh session; not run yet): the whole GPU suite on the twenty-sixth
# session's final code, whose last two changes have not run on a GPU: the GC guard in DecodeGraphs.capture (its
# test_decode_step_has_no_host_sync failed once in two runs of test_gpu_engine.py before it) and the f_b chunk
# capped at K; and the batched sampler's GPU test (tests/runtime/test_sampler_gpu.py: CPU and GPU draws equal, one
# sync a batch). The graph tests of tests/dist too.
source tools/device/env.sh
timeout 570 python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime tests/dist/test_graphs_nccl_gpu.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -25
