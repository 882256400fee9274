# Fifty-sixth device batch (twenty-first session): MoEInProj (the router's logits out of the MoE in_proj GEMM):
# the rank with --ab separate-router (the graph's former Linear + Router, forked from 64 tokens), then the GPU tests
# of MoEInProj, the router, the whole tiny engine and the NCCL graph test.
source tools/device/env.sh
source tools/device/rank_ab.sh
RANK_S=${RANK_S:-290} rank_ab separate-router
timeout ${TEST_S:-250} python3 -m pytest -q -m gpu tests/plugins/test_moe_in_gpu.py tests/plugins/test_router_gpu.py \
  tests/model/test_gpu_engine.py tests/dist/test_graphs_nccl_gpu.py -k "not tune" -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
