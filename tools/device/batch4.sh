# Fourth device batch: every GPU test (plugins + the whole tiny model on the GPU), then the KDA and MLA benchmarks.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-300} python3 -m pytest -q -m gpu ${TESTS:-tests/plugins tests/model/test_gpu_engine.py} \
  -p no:cacheprovider -rf 2>&1 | tail -40 | tee $OUT/pytest.txt
timeout ${BENCH_S:-240} python3 tools/bench_plugins.py --only "${ONLY:-kda,mla}" 2>&1 | tee $OUT/bench.jsonl
