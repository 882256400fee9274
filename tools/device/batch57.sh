# Fifty-seventh device batch (twenty-first session): MoEInProj's GPU test with its absolute bound, then one profiled
# eager step of the rank at 32 and 128 requests (where the step's time goes with MoEInProj).
source tools/device/env.sh
timeout 120 python3 -m pytest -q -m gpu tests/plugins/test_moe_in_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout 300 python3 tools/bench_rank.py --batches 32,128 --reps 5 --profile 2>&1 | grep '^{' > $OUT/rank_profile.jsonl
python3 tools/device/print_profile.py $OUT/rank_profile.jsonl 14
