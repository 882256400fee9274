# Sixty-sixth device batch (twenty-third session): the lane layout's MoE tactics (decode_l / prefill_l) on a GPU:
# their tests against the reference (and the overlapped down kernel's bits), then timed beside decode_p / prefill_p.
source tools/device/env.sh
timeout 240 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "decode_l or prefill_l" 2>&1 | tail -5
timeout 150 python3 tools/bench_plugins.py --only moe_touched 2>&1 | grep '^{' | tee $OUT/moe_touched.jsonl
timeout 180 python3 tools/bench_plugins.py --only moe 2>&1 | grep '^{' | grep -v moe_tile_pass | tee $OUT/moe.jsonl
