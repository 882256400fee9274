# Hundred-and-seventeenth device batch (fortieth session). On any card first: the GPU tests of the engine and
# runtime, where this session's load-time checks (runtime/graph_check.py, the weights header's rank, the config
# fields) meet sm90 engines for the first time. Then on an H200 batch116's figures (bench_plugins' MoE section,
# the rank at 32 requests with and without decode_l_sr); on another card the plugins' GPU tests instead.
# Carry fla-core's wheel (.whl). Ran once (2026-12-06, H200); decode_l_sr lost there and was removed after it, so
# its rank A/B switch (moe-scale-regs) is gone: drop that line to run it again.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 240 python3 -m pytest -q -m gpu tests/model tests/runtime -p no:cacheprovider --tb=short -rs \
  > $OUT/pytest_engine.txt 2>&1
grep -E "^E  |passed|failed|^FAILED" $OUT/pytest_engine.txt | tail -12
if [[ "$card" == *H200* ]]; then
  timeout 60 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' | cut -c1-500
  source tools/device/rank_ab.sh
  BATCHES=32 RANK_S=170 rank_ab moe-scale-regs
else
  timeout 280 python3 -m pytest -q -m gpu tests/plugins tests/dist/test_graphs_nccl_gpu.py -p no:cacheprovider \
    --tb=short -rs > $OUT/pytest_plugins.txt 2>&1
  grep -E "^E  |passed|failed|^FAILED" $OUT/pytest_plugins.txt | tail -12
fi
