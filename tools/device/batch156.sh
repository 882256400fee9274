# Hundred-and-fifty-sixth device batch (fifty-third session, little device time left): batch155's first part only:
# the new GPU tests of the shared MLA prefill launch and of prompts taken together, then the prompts beside decode
# rows, then the rows behind TOGETHER_*. Carry .whl.
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 120 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py -rf -p no:cacheprovider \
  -k "together or share_a_launch" 2>&1 | tail -4 | tee $OUT/tests.txt
timeout 60 python3 tools/device/mla_prefill_many.py --beside-decode 2>&1 | tee $OUT/beside.jsonl | cut -c1-300
timeout 60 python3 tools/device/mla_prefill_many.py --together 2>&1 | tee $OUT/together.jsonl | cut -c1-120
