# Hundred-and-third device batch (for the twenty-ninth session; not run yet): the whole GPU suite on the
# twenty-eighth session's final code. Not run on a GPU yet: the stronger page-row upload case and the per-row check
# of the preemption case (tests/model/test_gpu_engine.py), the feed-length check in RankRunner.run, the engine
# marked broken after a failed async step, async scheduling's default off on ROCm and with attention-DP.
source tools/device/env.sh
timeout 540 python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime tests/dist/test_graphs_nccl_gpu.py \
  -p no:cacheprovider --tb=short -rs > $OUT/pytest.txt 2>&1
grep -E "^E  |passed|failed|^FAILED" $OUT/pytest.txt | tail -20
