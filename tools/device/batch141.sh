# Hundred-and-forty-first device batch (forty-ninth session, the same warm H100): the un-absorbed prefill with its new
# defaults (3 stages, SPLIT_DIAGONAL on): its GPU tests and the mla_prefill bench rows again.
source tools/device/env.sh
timeout 120 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py tests/model/test_gpu_engine.py -k "unabsorbed" -p no:cacheprovider 2>&1 | tail -2
cd tools/bench && timeout 150 python3 - <<'PY' 2>&1 | tee $OUT/mla_prefill.jsonl
import json, torch
from common import mma_tflops
from mla import bench_mla_prefill
tflops = mma_tflops()
print(json.dumps({"mma_tflops": round(tflops, 1)}))
gen = torch.Generator(device="cuda").manual_seed(0)
for cached, chunk, H in ((8192, 2048, 96), (0, 512, 96), (2048, 256, 96), (8192, 2048, 16)):
    bench_mla_prefill(tflops, gen, cached=cached, chunk=chunk, H=H)
PY
