# Thirteenth device batch (prepared for the next session): the first GPU run of the Triton GLU (GatedMLP), the
# tl.topk router and the skinny GEMM, the router block sweep, the threaded weight reader, and the rank's dense
# GEMMs (cuBLAS against the skinny GEMM). Then batch14 (the rank). Under 600 s; each part has its own limit.
# (One `pytest -m gpu tests/plugins tests/runtime ...` call overran 260 s in batch11: the files are listed.)
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-170} python3 -m pytest -q -m gpu tests/plugins/test_norm_gpu.py tests/plugins/test_router_gpu.py \
  tests/plugins/test_mla_gpu.py tests/plugins/test_kda_gpu.py tests/plugins/test_moe_gpu.py \
  tests/runtime/test_weight_reader.py tests/runtime/test_host_store.py tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "assert|Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${ROUTER_S:-60} python3 tools/bench_plugins.py --sweep --only router 2>&1 | grep '^{' | tee $OUT/router.jsonl
for cache in "" "--warm"; do
  timeout ${LOAD_S:-80} python3 tools/bench_load.py --device cuda --gib 8 --repeat 3 $cache 2>&1 | grep '^{' \
    | tee -a $OUT/load.jsonl
done
timeout ${GEMM_S:-120} python3 tools/bench_rank.py --gemms --batches 32,64 2>&1 | grep '^{' | tee $OUT/gemms.jsonl \
  | grep -v '"rank_gemm"'
