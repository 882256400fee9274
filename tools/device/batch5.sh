# Fifth device batch: whole-model GPU tests (CUDA graphs, sync-free decode, parity vs fp32), KDA GPU tests,
# KDA bf16-state drift, the KDA bench (new conv prefill), then one real-size K3 TEP16 rank (tools/bench_rank.py).
source tools/device/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${TEST_S:-170} python3 -m pytest -q -m gpu ${TESTS:-tests/model/test_gpu_engine.py tests/plugins/test_kda_gpu.py} \
  -p no:cacheprovider -rf 2>&1 | tail -30 | tee $OUT/pytest.txt
timeout ${DRIFT_S:-50} python3 tools/bench_plugins.py --only kda_drift 2>&1 | tail -3 | tee $OUT/drift.jsonl
timeout ${KDA_S:-80} python3 tools/bench_plugins.py --only kda 2>&1 | tail -8 | tee $OUT/kda.jsonl
timeout ${RANK_S:-270} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps 5 2>&1 | tail -30 \
  | tee $OUT/rank.jsonl
