# Thirteenth device batch (prepared for the next session): the first GPU run of the Triton GLU (GatedMLP), the
# tl.topk router, the paired layout v2 and the split AttnRes; the router block sweep; AttnRes one program a token
# against split. Then batch14. Under 600 s; each part has its own limit. (On a fresh machine Triton compiles every
# kernel first: batch11's GPU tests overran 260 s, batch9's 30 took 122 s.)
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-400} python3 -m pytest -q -m gpu tests/plugins/test_norm_gpu.py tests/plugins/test_router_gpu.py \
  tests/plugins/test_mla_gpu.py tests/plugins/test_kda_gpu.py tests/plugins/test_moe_gpu.py \
  tests/runtime/test_weight_reader.py tests/runtime/test_host_store.py tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "assert|Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${ROUTER_S:-60} python3 tools/bench_plugins.py --sweep --only router 2>&1 | grep '^{' | tee $OUT/router.jsonl
timeout ${ATTN_S:-60} python3 tools/bench_plugins.py --sweep --only attn_res 2>&1 | grep '^{' | tee $OUT/attn_res.jsonl
