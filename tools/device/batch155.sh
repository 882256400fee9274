# Hundred-and-fifty-fifth device batch (fifty-third session): SHARED_LAUNCH on and prefill.TOGETHER_* (fresh prompts
# join the MHA form together): the MLA mixer's GPU tests and the engine's prompt logits, then bench_mla_prefill_many's
# rows (--beside-decode: prompts taken together beside decode rows, --together: the rows behind TOGETHER_*, then
# PREFILL_MANY_CASES); on an H200 the MoE section. Carry .whl.
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 240 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py tests/model -rf -p no:cacheprovider \
  -k "mixer or unabsorbed or prompt_logits" 2>&1 | tail -6 | tee $OUT/tests.txt
timeout 100 python3 tools/device/mla_prefill_many.py --beside-decode 2>&1 | tee $OUT/beside.jsonl | cut -c1-300
timeout 120 python3 tools/device/mla_prefill_many.py --together 2>&1 | tee $OUT/together.jsonl | cut -c1-200
timeout 60 python3 tools/device/mla_prefill_many.py 2>&1 | tee $OUT/many.jsonl | cut -c1-200
if [[ "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" == *H200* ]]; then
  K3_PDL=0 timeout 200 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' \
    | cut -c1-400
fi
