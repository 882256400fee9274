# Hundred-and-fortieth device batch (forty-ninth session, the same warm H100 as batch139): the un-absorbed prefill
# kernel's stages x split x block_n at 2048 after 8192 (96 heads), then the best rows at 256 after 2048 and 512 fresh.
source tools/device/env.sh
cd tools/bench && timeout 150 python3 - <<'PY' 2>&1 | tee $OUT/mha_tactics.jsonl
import json, torch
from common import time_ms
from mla import PAGE, SCALE
from k3plugins.mla import prefill
gen = torch.Generator(device="cuda").manual_seed(0)
def case(cached, chunk, H=96):
    total = cached + chunk
    kv = torch.randn(total // PAGE, PAGE, 576, device="cuda", generator=gen).to(torch.bfloat16)
    pt = torch.arange(total // PAGE, device="cuda", dtype=torch.int32)
    q = torch.randn(chunk, H, 192, device="cuda", generator=gen).to(torch.bfloat16)
    w_uk = (torch.randn(H, 128, 512, device="cuda", generator=gen) / 11).to(torch.bfloat16)
    w_uv = (torch.randn(H, 512, 128, device="cuda", generator=gen) / 22).to(torch.bfloat16)
    out = torch.empty(chunk, H, 128, dtype=torch.bfloat16, device="cuda")
    return lambda **k: prefill.mha_prefill(q, kv, pt, total, w_uk, w_uv, scale=SCALE, out=out, **k)
rows = [(128, 64, 8, 3, True), (128, 128, 8, 3, True), (128, 128, 8, 2, True), (128, 64, 8, 4, True),
        (128, 128, 8, 3, False), (128, 64, 8, 3, False), (128, 32, 8, 3, True), (64, 64, 4, 3, True)]
for cached, chunk, tactics in ((8192, 2048, rows), (2048, 256, rows[:4] + rows[5:6] + rows[7:]), (0, 512, rows[:4] + rows[5:6])):
    fn = case(cached, chunk)
    for bm, bn, nw, ns, sp in tactics:
        try:
            t = time_ms(lambda: fn(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, split=sp), rep=5)
            print(json.dumps({"bench": "mha_prefill_tactic", "cached": cached, "chunk": chunk, "block_m": bm,
                              "block_n": bn, "num_warps": nw, "num_stages": ns, "split": sp, "ms": round(t, 4)}))
        except Exception as e:
            print(json.dumps({"bench": "mha_prefill_tactic_failed", "block_n": bn, "num_stages": ns, "error": repr(e)[:200]}))
PY
