# Ninth device batch (prepared for the next session): the streamed GPU weight reader (its GPU tests, then
# bench_load against the disk/PCIe floor and load_file), the wide-experts engine test with its relative bar, the
# KDA conv sweep with the row-walking kernel, and diag_wide (strided vs natural expert bytes on one GPU).
# Each part has its own limit; together under 600 s.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-180} python3 -m pytest -q -m gpu tests/runtime/test_weight_reader.py tests/plugins/test_norm_gpu.py \
  tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short 2>&1 | grep -E "assert|Error|passed|failed" | tail -20 \
  | tee $OUT/pytest.txt
for cache in "" "--warm"; do
  timeout ${LOAD_S:-90} python3 tools/bench_load.py --device cuda --gib 8 --repeat 3 $cache 2>&1 | grep '^{' \
    | tee -a $OUT/load.jsonl
done
timeout ${KDA_S:-120} python3 tools/bench_plugins.py --sweep --only kda_prefill 2>&1 | tee $OUT/kda_prefill.jsonl \
  | grep -v '_config"'
timeout ${DIAG_S:-90} python3 tools/device/diag_wide.py 2>&1 | grep -E '^\{|Error' | tee $OUT/diag_wide.jsonl
