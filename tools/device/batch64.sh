# Sixty-fourth device batch (twenty-second session): CUDA graphs under attention-DP (an attention-DP rank on the
# one-process NCCL group) and the graph tests of one rank, of the TP2 rank and of the PP2 stages on the final code.
source tools/device/env.sh
timeout 300 python3 -m pytest -q -m gpu tests/dist/test_graphs_nccl_gpu.py tests/runtime/test_pp_graphs_gpu.py \
  tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -25
