# Hundred-and-fifty-third device batch (fifty-second session; not yet run, no device came in time): the MHA
# prefill of several sequences in one launch first (the mixer's un-absorbed GPU tests, the bench rows against one
# launch a sequence), then on an H200 the MoE decode section if time is left. Carry .whl.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 170 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py -rf -p no:cacheprovider -k "unabsorbed" 2>&1 \
  | tail -8 | tee $OUT/tests.txt
timeout 100 python3 tools/device/mla_prefill_many.py 2>&1 | tee $OUT/many.jsonl | cut -c1-900
if [[ "$card" == *H200* ]]; then
  K3_PDL=0 timeout 180 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' \
    | cut -c1-400
fi
