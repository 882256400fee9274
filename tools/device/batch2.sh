# Second device batch: all four benchmarks (with sweeps), then every GPU test of the plugins.
source tools/device/env.sh
timeout 420 python3 tools/bench_plugins.py --sweep --only "${ONLY:-moe,mla,kda,router}" 2>&1 | tee $OUT/bench.jsonl | grep -v '"moe_tactic"\|"mla_config"'
timeout 150 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/plugins/test_mla_gpu.py tests/plugins/test_kda_gpu.py tests/plugins/test_router_gpu.py -p no:cacheprovider -x 2>&1 | tail -30 | tee $OUT/pytest.txt
