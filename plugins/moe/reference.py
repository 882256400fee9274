"""Routed experts over MXFP4 (or plain float) weights, one rank's share (K3_SPEC.md §2.4, §3)."""
import torch

from k3plugins.mlp.reference import glu
from k3plugins.moe.mxfp4 import dequantize_mxfp4


def _expert_weight(packed: torch.Tensor, scale: torch.Tensor | None, name: str, rows: int,
                   cols: int) -> torch.Tensor:
    """One expert's [rows, cols] matrix in fp32, dequantised when `scale` is given."""
    if scale is None:
        if tuple(packed.shape) != (rows, cols):
            raise ValueError(f"moe_experts: {name} expert weight must be [{rows}, {cols}], got {tuple(packed.shape)}")
        return packed.float()
    if tuple(packed.shape) != (rows, cols // 2) or tuple(scale.shape) != (rows, cols // 32):
        raise ValueError(f"moe_experts: MXFP4 {name} must be packed [{rows}, {cols // 2}] with scale "
                         f"[{rows}, {cols // 32}], got {tuple(packed.shape)} and {tuple(scale.shape)}")
    return dequantize_mxfp4(packed, scale, dtype=torch.float32)


def moe_experts(z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None, *,
                expert_start: int, act: str, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Σ over each token's selected local experts of w · W2(act(W1 z, W3 z)).

    Args:
        z: [M, Dl] expert input (latent or hidden).
        topk_ids: [M, k] int64 global expert ids (from `route`).
        topk_weights: [M, k] fp32 routing weights.
        w13: [E_local, 2I, Dl/2] u8 MXFP4 (gate rows, then up rows) or [E_local, 2I, Dl] float.
        w13_scale: [E_local, 2I, Dl/32] u8 E8M0 scales, or None for float weights.
        w2: [E_local, Dl, I/2] u8 MXFP4 or [E_local, Dl, I] float.
        w2_scale: [E_local, Dl, I/32] u8, or None.
        expert_start: global id of this rank's first expert.
        act: "situ" | "silu".

    Returns:
        [M, Dl] fp32 partial sum over the local experts (the caller sums across ranks).
    """
    if z.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != z.shape[0]:
        raise ValueError(f"moe_experts: need z [M, Dl] and topk_ids/topk_weights [M, k]; got {tuple(z.shape)}, "
                         f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("moe_experts: w13_scale and w2_scale must both be given (MXFP4) or both be None")
    M, Dl = z.shape
    E_local = w13.shape[0]
    quant = w13_scale is not None
    inter = w2.shape[-1] * (2 if quant else 1)
    out = torch.zeros(M, Dl, dtype=torch.float32, device=z.device)
    zf = z.float()
    for e in range(E_local):
        tok, slot = (topk_ids == expert_start + e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        s13 = w13_scale[e] if quant else None
        s2 = w2_scale[e] if quant else None
        W13 = _expert_weight(w13[e], s13, "w13", 2 * inter, Dl)                  # [2I, Dl]
        W2 = _expert_weight(w2[e], s2, "w2", Dl, inter)                          # [Dl, I]
        h = zf[tok] @ W13.T                                                     # [n, 2I]
        a = glu(h[:, :inter], h[:, inter:], act=act, beta=beta, linear_beta=linear_beta)
        y = (a @ W2.T) * topk_weights[tok, slot].float()[:, None]               # [n, Dl]
        out.index_add_(0, tok, y)
    return out
