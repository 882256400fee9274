"""Attention residuals of a decode step (bench_plugins --only attn_res): one program a token against the split
form, and the torch reference, against the bytes floor (the K snapshots and the running sum read, the output
written). K3: D 7168, up to 8 snapshots."""

from __future__ import annotations

import torch

from common import emit, rel_l2, time_ms
from k3plugins.attn_res import reference as ref
from k3plugins.attn_res import triton as ar

D = 7168


def bench_attn_res(bw_tbps: float, sweep: bool) -> None:
    """Each form with and without the next RMSNorm fused (out_norm: the engine's AttnRes v3 nodes)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    for M in (32, 64, 128):
        for K in (1, 2, 4, 8):
            partial = torch.randn(M, D, device="cuda", generator=gen).to(torch.bfloat16)
            blocks = [torch.randn(M, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(K)]
            proj = torch.randn(D, device="cuda", generator=gen) * D ** -0.5
            nw = torch.ones(D, device="cuda", dtype=torch.bfloat16)
            out_norm = (1 + 0.1 * torch.randn(D, device="cuda", generator=gen)).to(torch.bfloat16)
            floor_ms = (K + 2) * M * D * 2 / (bw_tbps * 1e12) * 1e3
            for norm in (None, out_norm):
                kw = dict(eps=1e-6, out_norm=norm)
                want = ref.attn_res(partial, blocks, proj, nw, **kw)
                rec = dict(bench="attn_res", M=M, K=K, D=D, norm=norm is not None, floor_ms=round(floor_ms, 5),
                           torch_ref_ms=round(time_ms(lambda: ref.attn_res(partial, blocks, proj, nw, **kw)), 4))
                chunks = (0, ar.SPLIT_CHUNK) + ((256, 1024) if sweep else ())
                for split in chunks:
                    fn = lambda split=split: ar.attn_res(partial, blocks, proj, nw, split=split, **kw)  # noqa: E731
                    name = f"split{split}" if split else "token"
                    t = time_ms(fn)
                    rec[f"{name}_ms"] = round(t, 4)
                    rec[f"{name}_frac_of_floor"] = round(floor_ms / t, 3)
                    rec[f"{name}_rel_l2"] = rel_l2(fn(), want)
                emit(**rec)
