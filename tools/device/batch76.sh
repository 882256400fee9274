# Seventy-sixth device batch (twenty-fourth session): the fused combine reverted, the sort kept (read once when the
# pairs fit one block, no prefix sum on blocks without its expert, program E placing nothing): its GPU tests and
# the MoE decode's, the sort alone against the twenty-third session's, the decode's timeline, bench_plugins moe.
source tools/device/env.sh
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/plugins/test_norm_gpu.py -k \
  "sort or decode_l or decode_p or deterministic" -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -8
timeout 100 python3 tools/device/moe_sort_probe.py 2>&1 | grep -E '^\{|Error' | tee $OUT/moe_sort.jsonl
timeout 100 python3 tools/device/moe_fixed_probe.py 2>&1 | grep '^{' | tee $OUT/moe_fixed.jsonl | cut -c1-300
timeout 180 python3 tools/bench_plugins.py --only moe 2>&1 | grep '^{' | grep -v moe_tile_pass | tee $OUT/moe.jsonl \
  | grep '"bench": "moe"'
