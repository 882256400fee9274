# Seventieth device batch (twenty-third session): the lane tactics' GPU tests with prefill_l's new blocks, then one
# profiled eager step of the rank (triton_l) at 32 and 128 requests, every kernel (name, ms, launches).
source tools/device/env.sh
timeout 120 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "decode_l or prefill_l" 2>&1 | tail -2
timeout 400 python3 tools/bench_rank.py --batches 32,128 --reps 5 --profile 2>&1 | grep '^{' > $OUT/rank_profile.jsonl
python3 tools/device/print_profile.py $OUT/rank_profile.jsonl
