# Ninety-sixth device batch (twenty-seventh session): async scheduling on the GPU. Its GPU test (graphs fed on the
# device, the sync engine's samples, no host sync while launching) with the rest of test_gpu_engine.py; then the
# rank in two processes with the runtime's loop timed synchronous and async (bench_rank loop_sync_ms /
# loop_async_ms: staging, replay, greedy sampling and the host's read of the tokens, steps back to back).
source tools/device/env.sh
source tools/device/rank_ab.sh
timeout 200 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -15
for i in 1 2; do RANK_S=150 RANK_OUT=rank_$i RANK_KEYS="batch step_ms graph_ms loop_ host_ gpu_ hbm" rank_ab; done
