# Hundred-and-thirty-ninth device batch (forty-ninth session): the un-absorbed MLA prefill (prefill.py, new) first:
# its GPU tests, the prefill bench at several (cached, chunk) shapes against the absorbed kernels, a sweep of its
# kernel's blocks (batch138, the MoE prefetch_per_sm rows, runs next if the machine stays).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 150 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py tests/model/test_gpu_engine.py -k "mixer or prompt_logits or write_cache" -p no:cacheprovider 2>&1 | tail -4
cd tools/bench && timeout 180 python3 - <<'PY' 2>&1 | tee $OUT/mla_prefill.jsonl
import json, torch
from common import mma_tflops, time_ms
from mla import bench_mla_prefill, PAGE, SCALE
from k3plugins.mla import prefill
tflops = mma_tflops()
print(json.dumps({"mma_tflops": round(tflops, 1)}))
gen = torch.Generator(device="cuda").manual_seed(0)
for cached, chunk, H in ((8192, 2048, 96), (0, 512, 96), (2048, 256, 96), (8192, 2048, 16)):
    bench_mla_prefill(tflops, gen, cached=cached, chunk=chunk, H=H)
# the un-absorbed kernel's blocks at 2048 after 8192, 96 heads
H, total, chunk = 96, 10240, 2048
kv = torch.randn(total // PAGE, PAGE, 576, device="cuda", generator=gen).to(torch.bfloat16)
pt = torch.arange(total // PAGE, device="cuda", dtype=torch.int32)
q = torch.randn(chunk, H, 192, device="cuda", generator=gen).to(torch.bfloat16)
w_uk = (torch.randn(H, 128, 512, device="cuda", generator=gen) / 11).to(torch.bfloat16)
w_uv = (torch.randn(H, 512, 128, device="cuda", generator=gen) / 22).to(torch.bfloat16)
out = torch.empty(chunk, H, 128, dtype=torch.bfloat16, device="cuda")
for bm, bn, nw, ns, sp in ((128, 64, 8, 2, False), (128, 64, 8, 2, True), (128, 64, 4, 2, False),
                           (128, 128, 8, 2, False), (128, 64, 8, 3, False), (64, 64, 4, 2, False)):
    try:
        t = time_ms(lambda: prefill.mha_prefill(q, kv, pt, total, w_uk, w_uv, scale=SCALE, out=out, block_m=bm,
                                                block_n=bn, num_warps=nw, num_stages=ns, split=sp), rep=5)
        print(json.dumps({"bench": "mha_prefill_tactic", "block_m": bm, "block_n": bn, "num_warps": nw,
                          "num_stages": ns, "split": sp, "ms": round(t, 4)}))
    except Exception as e:
        print(json.dumps({"bench": "mha_prefill_tactic_failed", "block_m": bm, "block_n": bn, "error": repr(e)[:200]}))
PY
