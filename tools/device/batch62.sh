# Sixty-second device batch (twenty-second session): CUDA graphs for pipeline stages (the PP2 test, and the graph
# tests of one rank and of the one-process NCCL group on the changed DecodeGraphs), then PDL on every Triton kernel
# against the default at 32, 64 and 128 requests.
source tools/device/env.sh
timeout 240 python3 -m pytest -q -m gpu tests/runtime/test_pp_graphs_gpu.py tests/model/test_gpu_engine.py \
  tests/dist/test_graphs_nccl_gpu.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -25
source tools/device/rank_ab.sh
RANK_S=300 rank_ab pdl
