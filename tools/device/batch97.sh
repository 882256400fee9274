# Ninety-seventh device batch (twenty-seventh session): async scheduling with the sampled tokens copied to pinned
# memory right after sampling (llm_engine.HostCopy). batch96 and a profile of the loop (bench_rank
# --loop-timeline) showed the async loop slower than the sync one: reading the previous step's tokens with
# .tolist() queued the copy behind the step just launched, so the host waited for it. The GPU test again, then the
# rank in two processes, loop_sync_ms against loop_async_ms.
source tools/device/env.sh
source tools/device/rank_ab.sh
timeout 170 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short \
  -k "async or graph or sync" > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -15
for i in 1 2; do RANK_S=140 RANK_OUT=rank_$i RANK_KEYS="batch step_ms graph_ms loop_ hbm" rank_ab; done
