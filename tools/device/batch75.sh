# Seventy-fifth device batch (twenty-fourth session): the MoE decode's combine inside the down kernel
# (MoETactic.fused_combine: each column block's last program sums it) and the sort without a prefix sum for
# blocks that lack its expert: the GPU tests of the MoE and the sort, the fixed-cost probe (fused against the
# combine kernel, one process), bench_plugins' moe and moe_touched.
# Reproduces batch75 at commit 8c7d59f only: the fused combine and the probe's two variants were reverted after it.
source tools/device/env.sh
timeout 300 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/plugins/test_norm_gpu.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -12
timeout 120 python3 tools/device/moe_fixed_probe.py 2>&1 | grep '^{' | tee $OUT/moe_fixed.jsonl | cut -c1-400
timeout 150 python3 tools/bench_plugins.py --only moe_touched 2>&1 | grep '^{' | tee $OUT/moe_touched.jsonl
timeout 180 python3 tools/bench_plugins.py --only moe 2>&1 | grep '^{' | grep -v moe_tile_pass | tee $OUT/moe.jsonl
