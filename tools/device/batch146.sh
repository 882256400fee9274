# Hundred-and-forty-sixth device batch (fifty-first session): chunk_kda's chunk layout built on the device
# (kda.fla.CHUNK_LAYOUT_ON_DEVICE, fla's use_graph): its GPU tests (bit for bit the host layout's, no sync under
# "error"; the tiny engine's eager prefill step with no sync at all), then bench_plugins' KDA prefill section (its
# new kda_prefill_layout rows: 8 layers a step, device layout against host layout); on an H200 also the MoE section
# (the engine's decode_l_pf). Carry .whl.
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py tests/model/test_gpu_engine.py -rf \
  -p no:cacheprovider -k "prefill" 2>&1 | tail -15 | tee $OUT/tests.txt
timeout 200 python3 tools/bench_plugins.py --only kda_prefill 2>&1 | tee $OUT/kda_prefill.jsonl | cut -c1-600
if [[ "$card" == *H200* ]]; then
  K3_PDL=0 timeout 200 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' \
    | cut -c1-400
fi
