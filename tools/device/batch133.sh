# Hundred-and-thirty-third device batch (forty-seventh session): the MLA bench's prefill case alone (never run
# before: 2048 new tokens after 8192 cached, 96 heads, against the exact heads' math and the Triton kernel), with the
# Gluon kernel's defaults of this session (LEAN_SOFTMAX on).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
cd tools/bench && timeout 150 python3 - <<'PY'
import torch
from common import mma_tflops
from mla import bench_mla_prefill
torch.manual_seed(0)
tflops = mma_tflops()
print({"mma_tflops": round(tflops, 1)})
bench_mla_prefill(tflops, torch.Generator(device="cuda").manual_seed(0))
PY
