# Ninth device batch (prepared for the next session): the streamed GPU weight reader (its GPU tests, then
# bench_load against the disk/PCIe floor and load_file), and the wide-experts engine test with its relative bar.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/runtime/test_weight_reader.py tests/plugins/test_norm_gpu.py \
  tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short 2>&1 | grep -E "assert|Error|passed|failed" | tail -20 \
  | tee $OUT/pytest.txt
for cache in "" "--warm"; do
  timeout ${LOAD_S:-150} python3 tools/bench_load.py --device cuda --gib 16 --repeat 3 $cache 2>&1 | grep '^{' \
    | tee -a $OUT/load.jsonl
done
# the wide-experts engine on the same GPU with strided bytes (triton_s) and natural ones (triton): they should agree
# far more closely than either agrees with fp32 (batch8 cut this at 90 s before it printed)
timeout ${DIAG_S:-200} python3 tools/device/diag_wide.py 2>&1 | grep -E '^\{|Error' | tee $OUT/diag_wide.jsonl
