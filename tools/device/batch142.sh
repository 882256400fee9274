# Hundred-and-forty-second device batch (written in the forty-ninth session for the next H200; not yet run): the
# issue's H200 figures with this session's changes, most wanted first. bench_plugins' MoE section (the engine's
# decode_l_pf among the tactics: was 0.786 of the floor at 8 tokens an expert), the rank at 32 requests with and
# without the MoE prefetch (bench_rank --ab moe-no-prefetch), the MLA prefill rows (un-absorbed against absorbed,
# with chunks under MIN_NEW_TOKENS to place the threshold).
# On another card it runs the prefill rows only. Carry fla-core's wheel (.whl).
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ "$card" == *H200* ]]; then
  K3_PDL=0 timeout 200 python3 tools/bench_plugins.py --only moe 2>&1 | tee $OUT/moe.jsonl | grep '"bench": "moe"' \
    | cut -c1-500
  source tools/device/rank_ab.sh
  BATCHES=32 RANK_S=170 rank_ab moe-no-prefetch
fi
cd tools/bench && timeout 120 python3 - <<'PY' 2>&1 | tee $OUT/mla_prefill.jsonl
import json, torch
from common import mma_tflops
from mla import PREFILL_CASES, bench_mla_prefill
tflops = mma_tflops()
print(json.dumps({"mma_tflops": round(tflops, 1)}))
gen = torch.Generator(device="cuda").manual_seed(0)
# the standard rows, then shorter chunks (MIN_NEW_TOKENS is 256; the FLOP break-even about 170), at 96 heads and at
# a TP slice's 16 and 6 (K3 at TP16), where the absorbed kernel pads heads to 16-row blocks
for cached, chunk, H in PREFILL_CASES + ((2048, 128, 96), (2048, 192, 96), (8192, 192, 96), (2048, 128, 16),
                                         (2048, 64, 16), (2048, 256, 6), (2048, 128, 6), (2048, 64, 6)):
    bench_mla_prefill(tflops, gen, cached=cached, chunk=chunk, H=H)
PY
