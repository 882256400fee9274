# Hundred-and-fiftieth device batch (written in the fifty-first session for the next one; not yet run): first the
# GPU tests of the un-absorbed MLA prefill with prefill.query_block's 64-row blocks (the mixer's 300-token chunk at
# 6 heads takes them; the device time ran out before they could run), the tiny model's prompt logits and prefill
# step; then the MLA prefill rows (mla_prefill_rows.py: whether MIN_NEW_TOKENS could go lower at 6 and 16 heads now
# that short chunks there run 17-20 % faster); on an H200 also the MoE section (the engine's decode_l_pf at 1-8
# tokens an expert, never measured there). Carry .whl.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py tests/model/test_gpu_engine.py -rf \
  -p no:cacheprovider -k "unabsorbed or prompt_logits or chunk_layout" 2>&1 | tail -8 | tee $OUT/tests.txt
timeout 150 python3 tools/device/mla_prefill_rows.py --short 2>&1 | tee $OUT/mla_prefill.jsonl | cut -c1-700
if [[ "$card" == *H200* ]]; then
  K3_PDL=0 timeout 200 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' \
    | cut -c1-400
fi
