# Hundred-and-fifty-second device batch (fifty-second session): on an H200 first the MoE decode section (the engine's
# decode_l_pf at 1-8 tokens an expert, never measured there), then batch151's: the MHA prefill of several sequences
# in one launch (its GPU tests, the mixer's un-absorbed ones; the bench rows against one launch a sequence).
# Carry .whl.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ "$card" == *H200* ]]; then
  K3_PDL=0 timeout 190 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' \
    | cut -c1-400
fi
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py -rf -p no:cacheprovider -k "unabsorbed" 2>&1 \
  | tail -8 | tee $OUT/tests.txt
timeout 130 python3 tools/device/mla_prefill_many.py 2>&1 | tee $OUT/many.jsonl | cut -c1-900
