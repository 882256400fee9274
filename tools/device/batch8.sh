# Eighth device batch: why the wide-experts engine missed its parity bar (diag_wide.py: strided vs natural bytes
# vs the CPU bf16 engine, all against fp32), the GPU tests (norm/AttnRes/sort kernels, MoE, whole model), the rank.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${DIAG_S:-90} python3 tools/device/diag_wide.py 2>&1 | grep '^{' | tee $OUT/diag_wide.jsonl
timeout ${TEST_S:-170} python3 -m pytest -q -m gpu tests/plugins/test_norm_gpu.py tests/plugins/test_moe_gpu.py tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short 2>&1 | grep -E "assert|Error|passed|failed" | tail -20 | tee $OUT/pytest.txt
timeout ${RANK_S:-80} python3 tools/bench_rank.py --batches 32,128 --reps 3 2>&1 | grep '^{' | tee $OUT/rank.jsonl
