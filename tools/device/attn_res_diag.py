"""Where the fused-norm AttnRes and the unfused launches differ most (test_norm_gpu.py's case, nineteenth session)."""
import json

import torch

from k3plugins.attn_res import triton as ar
from k3plugins.norm import triton as norm

for K, M, D, split in ((8, 128, 7168, 512), (11, 128, 7168, 512), (8, 128, 7168, 0), (8, 1, 7168, 512)):
    g = torch.Generator(device="cuda").manual_seed(K * 1000 + M + 7)
    partial = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    blocks = [torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(K)]
    proj, nw = torch.randn(D, device="cuda", generator=g) * D ** -0.5, torch.ones(D, device="cuda")
    weight = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    pow2 = torch.exp2(torch.randint(-1, 2, (D,), device="cuda", generator=g).float()).to(torch.bfloat16)
    got = ar.attn_res(partial, blocks, proj, nw, eps=1e-6, out_norm=pow2, out_eps=1e-5, split=split)
    mixed = ar.attn_res(partial, blocks, proj, nw, eps=1e-6, split=split)
    unf = norm.rms_norm(mixed, pow2, eps=1e-5)
    d = (got.float() - unf.float()).abs()
    top = d.flatten().topk(5)
    rows = {}
    for v, i in zip(top.values.tolist(), top.indices.tolist()):
        r, c = i // D, i % D
        rows[f"{r},{c}"] = dict(diff=v, got=got[r, c].item(), unf=unf[r, c].item(), mixed=mixed[r, c].item(),
                                w=pow2[c].item())
    print(json.dumps(dict(K=K, M=M, split=split, n_diff=int((d > 0).sum()), worst=rows)))
