# Hundred-and-twentieth device batch (forty-second session): the GPU engine tests and the NCCL graph test on this
# session's runtime changes (the loader's checks and reads, the multi-rank preflight and keep-alive, the Triton
# model's sender thread is CPU-side). Carry fla-core's wheel.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 300 python3 -m pytest -q -m gpu tests/model tests/runtime tests/dist/test_graphs_nccl_gpu.py \
  -p no:cacheprovider --tb=short -rs > $OUT/pytest_engine.txt 2>&1
grep -E "^E  |passed|failed|^FAILED" $OUT/pytest_engine.txt | tail -15
