# Seventeenth device batch (twelfth session): the MoE decode on row-tiled expert bytes (decode_pt, tile_rows: a
# K step reads one contiguous 8 KB block, not 64 runs of 128 bytes) against the paired layout, side by side with
# their moe_check; the rank at 32/64/128 (batch14: 2.11x / 1.89x / 1.85x; since then: AttnRes split, router blocks,
# KDA in_proj padded, latent MoE input as one GEMM, MLA q_a/kv_a/g as one GEMM); the MoE with Triton's MMA v2
# (DISABLE_MMA_V3=1, own cache dir); one profiled step; then the GPU tests of the changed plugins.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${MOE_S:-90} python3 tools/bench_plugins.py --only moe 2>&1 | grep '^{' | tee $OUT/moe_wgmma.jsonl \
  | grep -E '"bench": "moe"|decode_p|moe_check'
timeout ${RANK_S:-130} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps 3 2>&1 | grep '^{' \
  | tee $OUT/rank.jsonl
DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/tc_mma_v2 timeout ${MOE_S:-90} python3 tools/bench_plugins.py --only moe 2>&1 \
  | grep '^{' | tee $OUT/moe_mma_v2.jsonl | grep -E '"bench": "moe"|decode_p'
timeout ${PROF_S:-50} python3 tools/bench_rank.py --batches 32 --reps 3 --profile 2>&1 | grep rank_profile \
  > $OUT/profile.jsonl
[ "${TEST_S:-150}" = 0 ] || timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py \
  tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
