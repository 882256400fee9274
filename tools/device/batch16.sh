# Sixteenth device batch (eleventh session, after batch13-14): the GPU tests of what changed since (AttnRes split
# by default, router blocks by batch, KDA in_proj padded, the latent MoE's fused input GEMM and its SplitColumns
# view, the removals); the rank at 32/64/128 requests against batch14's 2.11x / 1.89x / 1.85x; the MoE decode
# with Triton's MMA v2 (DISABLE_MMA_V3=1, own cache dir: the variable is not in Triton's cache key) against
# wgmma, side by side; one profiled step. Under 500 s, most needed first. The tests passed in the eleventh
# session (80); TEST_S=0 skips them.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
[ "${TEST_S:-180}" = 0 ] || timeout ${TEST_S:-180} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/plugins/test_norm_gpu.py \
  tests/plugins/test_router_gpu.py tests/plugins/test_kda_gpu.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${RANK_S:-130} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps 3 2>&1 | grep '^{' | tee $OUT/rank.jsonl
DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/tc_mma_v2 timeout ${MOE_S:-60} python3 tools/bench_plugins.py --only moe 2>&1 \
  | grep '^{' | tee $OUT/moe_mma_v2.jsonl | grep '"bench": "moe"'
timeout ${MOE_S:-60} python3 tools/bench_plugins.py --only moe 2>&1 | grep '^{' | tee $OUT/moe_wgmma.jsonl \
  | grep '"bench": "moe"'
timeout ${PROF_S:-50} python3 tools/bench_rank.py --batches 32 --reps 3 --profile 2>&1 | grep rank_profile \
  > $OUT/profile.jsonl
