# First device batch: MoE + MLA benchmarks with the config sweep, then their GPU tests.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 360 python3 tools/bench_plugins.py --only moe,mla --sweep 2>&1 | tee $OUT/bench.jsonl | grep -v '"moe_tactic"\|"mla_config"'
timeout 150 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/plugins/test_mla_gpu.py -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/pytest.txt
