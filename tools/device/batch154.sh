# Hundred-and-fifty-fourth device batch (fifty-third session): batch153 (the shared MHA prefill launch's GPU tests and
# rows; on an H200 the MoE decode section), then the MHA threshold's unmeasured edge: 128 new tokens at 32 and 48
# heads (prefill.min_new_tokens takes 192 there). Carry .whl.
source tools/device/env.sh
bash tools/device/batch153.sh
timeout 120 python3 tools/device/mla_prefill_rows.py --rows 2048,128,32 8192,128,32 2048,128,48 8192,128,48 \
  2>&1 | tee $OUT/rows.jsonl | cut -c1-600
