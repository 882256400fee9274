# Eightieth device batch (twenty-fourth session), after the review: the sort's GPU test with a 7168-pair case (one
# block of 8192, 8 warps: the path bench_plugins' 8 tokens/expert takes), and the sort probe without its repeats.
source tools/device/env.sh
timeout 120 python3 -m pytest -q -m gpu tests/plugins/test_norm_gpu.py -k sort -p no:cacheprovider --tb=short 2>&1 | tail -2
timeout 100 python3 tools/device/moe_sort_probe.py 2>&1 | grep -E '^\{|Error' | tee $OUT/moe_sort.jsonl
