# Hundred-and-forty-fourth device batch (fiftieth session, for a short device budget): this session's GPU tests
# first (the MLA mixer's un-absorbed prefill under sync_debug "error", its direct bf16 store; the whole tiny engine
# file, with the prefill step's sync count), then on an H200 the MoE section of bench_plugins (the engine's
# decode_l_pf), then the MLA prefill rows of batch142 (short chunks; 96, 16 and 6 heads). Carry .whl.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 150 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py tests/model/test_gpu_engine.py -rf \
  -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/tests.txt
if [[ "$card" == *H200* ]]; then
  K3_PDL=0 timeout 200 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' \
    | cut -c1-400
fi
timeout 180 python3 tools/device/mla_prefill_rows.py 2>&1 | tee $OUT/mla_prefill.jsonl | cut -c1-700
