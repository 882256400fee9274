# Fifth device batch: the whole-model GPU tests (CUDA graphs, sync-free decode), KDA bf16-state drift,
# then one real-size K3 TEP16 rank decoding (tools/bench_rank.py).
source tools/device/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu ${TESTS:-tests/model/test_gpu_engine.py} -p no:cacheprovider -rf \
  2>&1 | tail -40 | tee $OUT/pytest.txt
timeout ${DRIFT_S:-60} python3 tools/bench_plugins.py --only kda_drift 2>&1 | tail -5 | tee $OUT/drift.jsonl
timeout ${RANK_S:-300} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps 5 2>&1 | tail -30 \
  | tee $OUT/rank.jsonl
