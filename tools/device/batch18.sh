# Eighteenth device batch (twelfth session), most needed first: the GPU tests with programmatic dependent launch on
# (K3_PDL=1; k3plugins/pdl.py) over the triton_p v3 build path (row-tiled expert bytes): engine on the GPU against
# the CPU and fp32 engines, CUDA-graph decode equal to eager, no host sync (the tiled MoE kernels passed at op level in batch17); then the rank at
# 32/128 with PDL (batch17, on v2 and without PDL: 2.015x / 1.806x / 1.702x) and at 32 without it.
source tools/device/env.sh
K3_PDL=1 timeout ${TEST_S:-120} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/build/test_device_tactics.py \
  -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
K3_PDL=1 timeout ${RANK_S:-100} python3 tools/bench_rank.py --batches ${BATCHES:-32,128} --reps 3 2>&1 | grep '^{' \
  | tee $OUT/rank_pdl.jsonl | grep rank_decode
K3_PDL=0 timeout ${RANK0_S:-60} python3 tools/bench_rank.py --batches 32 --reps 3 2>&1 | grep '^{' \
  | tee $OUT/rank_no_pdl.jsonl | grep rank_decode
