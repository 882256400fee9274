"""KDA decode with bf16 state storage vs fp32 over 4096 steps: how far outputs and states drift (no timing).

The same random token stream (H=96, K=128, N=8 requests, slow gates so the state keeps a long memory) is fed
to the engine's decode kernel twice, once with an fp32 and once with a bf16 slot pool; the kernel computes in
fp32 either way, so the gap is the storage rounding accumulated through the recurrence.
"""

from __future__ import annotations

import torch

from common import emit, rel_l2
from k3plugins.kda import fla as kda_dev

H, K, N, STEPS = 96, 128, 8, 4096
D = H * K
REPORT = (1, 16, 256, 1024, 4096)


def bench_kda_drift(bw_tbps: float, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    r = lambda *s, sc=1.0: torch.randn(*s, device="cuda", generator=gen) * sc
    conv_w, a_log, dt_bias, norm_w = r(3 * D, 4, sc=0.5), r(H, sc=0.5), r(D, sc=0.5), 1 + 0.1 * r(K)
    slots = torch.arange(N, device="cuda", dtype=torch.int32)
    pools = {dt: torch.zeros(N, H, K, K, device="cuda", dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    convs = {dt: torch.zeros(N, 3 * D, 3, device="cuda", dtype=torch.bfloat16) for dt in pools}
    worst, rec = 0.0, dict(bench="kda_state_drift", H=H, K=K, N=N, steps=STEPS)
    for step in range(1, STEPS + 1):
        qkv = r(N, 3 * D).to(torch.bfloat16)
        g_raw, b, g_out = r(N, D) - 3.0, r(N, H), r(N, D)  # g_raw - 3: decays close to 1, long memory
        outs = {dt: kda_dev.kda_decode(qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pools[dt], convs[dt],
                                       slots, num_heads=H, head_dim=K, lower_bound=-5.0, eps=1e-5).float()
                for dt in pools}
        err = rel_l2(outs[torch.bfloat16], outs[torch.float32])
        worst = max(worst, err)
        if step in REPORT:
            rec[f"out_rel_l2_step{step}"] = err
            rec[f"state_rel_l2_step{step}"] = rel_l2(pools[torch.bfloat16].float(), pools[torch.float32])
    rec["out_rel_l2_max"] = worst
    emit(**rec)
