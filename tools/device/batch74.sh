# Seventy-fourth device batch (twenty-third session): on the session's final code (after the review: the PTX
# multiply only for lane tactics on sm_90; the lane tactics' plain bf16 product tested too), the GPU tests the
# review's changes touch: every MoE kernel case and the engines end to end (the rest of the suite ran in batch68).
source tools/device/env.sh
timeout 300 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -25
