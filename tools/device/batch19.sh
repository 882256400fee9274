# Nineteenth device batch (for the thirteenth session): finish what batch18 could not. The GPU tests with
# programmatic dependent launch on (K3_PDL=1), to completion (batch18's stopped at 120 s during the cold compile,
# 4 passed); then the rank at 32/64/128 with and without PDL, side by side (batch18: 30.91 against 31.50 ms at 32).
# If the tests pass and PDL wins, make it the default in k3plugins/pdl.py.
source tools/device/env.sh
K3_PDL=1 timeout ${TEST_S:-300} python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/build/test_device_tactics.py \
  tests/plugins/test_moe_gpu.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
for pdl in 1 0; do
  K3_PDL=$pdl timeout ${RANK_S:-130} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps 3 2>&1 \
    | grep '^{' | tee $OUT/rank_pdl$pdl.jsonl | grep rank_decode
done
# The KDA decode's state slice at the rank's 6 heads (bench_kda's sweep, H 6 rows): whether a narrower block_v
# beats the default 128 where N x 6 programs are few.
timeout ${KDA_S:-120} python3 tools/bench_plugins.py --only kda --sweep 2>&1 | grep '^{' | tee $OUT/kda_sweep.jsonl \
  | grep '"H": 6'
