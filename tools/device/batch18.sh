# Eighteenth device batch (twelfth session): the rank at 32/64/128 with triton_p v3 (row-tiled expert bytes; batch17
# measured it on v2: 2.015x / 1.806x / 1.702x) and programmatic dependent launch (k3plugins/pdl.py), then the same
# rank with K3_PDL=0 at 32 and 128 (PDL's share, side by side); then the GPU tests of the v3 build path (engine on
# the GPU: CUDA-graph decode equal to eager, no host sync, now with PDL) and of the MoE tactics.
source tools/device/env.sh
timeout ${RANK_S:-130} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps 3 2>&1 | grep '^{' \
  | tee $OUT/rank.jsonl | grep rank_decode
K3_PDL=0 timeout ${RANK_S:-130} python3 tools/bench_rank.py --batches 32,128 --reps 3 2>&1 | grep '^{' \
  | tee $OUT/rank_no_pdl.jsonl | grep rank_decode
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/plugins/test_moe_gpu.py \
  tests/build/test_device_tactics.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
