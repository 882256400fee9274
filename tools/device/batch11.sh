# Eleventh device batch: the whole GPU suite after triton_p became the sm90 MoE default and the row-walking conv
# the KDA prefill's, the KDA benches (decode and prefill, the projections' outputs in bf16 as the engine hands them
# over), then the rank at 32/64/128 requests with one profiled eager step at 32. Under 600 s.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-260} python3 -m pytest -q -m gpu tests/plugins tests/runtime tests/model/test_gpu_engine.py \
  -p no:cacheprovider --tb=short 2>&1 | grep -E "assert|Error|passed|failed" | tail -20 | tee $OUT/pytest.txt
timeout ${KDA_S:-90} python3 tools/bench_plugins.py --only kda 2>&1 | grep '^{' | tee $OUT/kda.jsonl
timeout ${RANK_S:-170} python3 tools/bench_rank.py --batches 32,64,128 --reps 3 2>&1 | grep '^{' \
  | tee $OUT/rank.jsonl | grep -v rank_profile
timeout ${PROF_S:-60} python3 tools/bench_rank.py --batches 32 --reps 3 --profile 2>&1 | grep rank_profile \
  > $OUT/profile.jsonl
