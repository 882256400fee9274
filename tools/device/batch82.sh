# Record only: the switches and the synced AttnRes it ran were reverted after this run (BENCHMARKS.md,
# twenty-fifth session).
# Eighty-second device batch (twenty-fifth session): AttnRes's split form in one launch (attn_res_synced_kernel)
# and the router top-k's cast in programs of its own: their GPU tests, then the rank with --ab
# attn-res-two-launches (one process) and one profiled graph replay (--timeline).
source tools/device/env.sh
timeout 240 python3 -m pytest -q -m gpu tests/plugins/test_norm_gpu.py tests/plugins/test_moe_in_gpu.py \
  tests/plugins/test_router_gpu.py -k "attn_res or moe_in or route or select" -p no:cacheprovider --tb=short 2>&1 \
  | tail -4
source tools/device/rank_ab.sh
RANK_S=200 RANK_OUT=rank_ab rank_ab attn-res-two-launches
timeout 120 python3 tools/bench_rank.py --batches 32 --reps 5 --timeline 2>&1 | grep '^{' > $OUT/timeline.jsonl
