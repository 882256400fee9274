# Hundred-and-eighteenth device batch (forty-first session): the whole GPU suite on the code after the fortieth
# session's last GPU run (9eec241): decode_l_sr's removal (the MoE kernel back to its form before SREG) and the
# multi-rank changes (keep-alive, load barrier, build id) meet a GPU for the first time. Carry fla-core's wheel.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 230 python3 -m pytest -q -m gpu tests/model tests/runtime -p no:cacheprovider --tb=short -rs \
  > $OUT/pytest_engine.txt 2>&1
grep -E "^E  |passed|failed|^FAILED" $OUT/pytest_engine.txt | tail -12
timeout 330 python3 -m pytest -q -m gpu tests/plugins tests/dist/test_graphs_nccl_gpu.py -p no:cacheprovider \
  --tb=short -rs > $OUT/pytest_plugins.txt 2>&1
grep -E "^E  |passed|failed|^FAILED" $OUT/pytest_plugins.txt | tail -12
