# Hundred-and-third device batch: the whole GPU suite on the latest code. Run in the thirty-first session
# (2026-12-05): 308 passed, 16 skipped (BENCHMARKS.md, pytest -m gpu). It was the first GPU run of: the stronger
# page-row upload case and the per-row check of the preemption case (tests/model/test_gpu_engine.py), the
# feed-length check in RankRunner.run, the engine marked broken after a failed async step, async scheduling's
# default off on ROCm and with attention-DP.
# Twenty-ninth session (no device lent): the feed split by micro-batch in RankRunner.run (one micro-batch without
# pipeline stages), share_tokens from a given rank, EngineOptions validated when made; a two-stage replay of fed
# ids in both micro-batches (tests/runtime/test_pp_graphs_gpu.py, both stages in one process). Async scheduling
# over pipeline stages end to end needs two GPUs (NCCL refuses two ranks on one device).
# Thirtieth session (no device lent): the two-stage replay of a step whole (Step.micro_batches = 1, its logits not
# copied) beside the cut one; decode_l_yh (bf16 per-pair rows) in every MoE case and against decode_l
# (test_half_pair_rows_match_reference); logprobs on the graphs with async scheduling (test_logprobs_on_the_gpu).
# Thirty-third session (no device lent): penalties and min_tokens' bans on the GPU against the CPU with no sync
# (tests/runtime/test_sampler_gpu.py), prompt logprobs' rows in step_logprobs without a sync (test_logprobs_on_the_gpu).
source tools/device/env.sh
timeout 540 python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime tests/dist/test_graphs_nccl_gpu.py \
  -p no:cacheprovider --tb=short -rs > $OUT/pytest.txt 2>&1
grep -E "^E  |passed|failed|^FAILED" $OUT/pytest.txt | tail -20
