# Hundred-and-fifty-first device batch (fifty-second session): the MHA prefill of several sequences in one launch
# (prefill.mha_prefill_varlen): its GPU tests and the mixer's un-absorbed ones, then the bench rows against one
# launch a sequence. Carry .whl.
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 240 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py -rf -p no:cacheprovider \
  -k "unabsorbed" 2>&1 | tail -8 | tee $OUT/tests.txt
timeout 200 python3 tools/device/mla_prefill_many.py 2>&1 | tee $OUT/many.jsonl | cut -c1-900
