"""Attention Residuals: a per-token softmax over depth (K3_SPEC.md §2.1)."""
from collections.abc import Sequence

import torch

from k3plugins.norm.reference import rms_norm


def attn_res(partial: torch.Tensor, blocks: torch.Tensor | Sequence[torch.Tensor], proj: torch.Tensor,
             norm_weight: torch.Tensor, *, eps: float, delta: torch.Tensor | None = None,
             out_norm: torch.Tensor | None = None,
             out_eps: float = 1e-5) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mix the block snapshots and the running sum by a softmax over depth.

    Args:
        partial: [M, D] running sum of the current block (the last candidate).
        blocks: [K, M, D] block snapshots, oldest first, or a sequence of K [M, D] tensors; K may be 0.
        proj: [D] the checkpoint's [1, D] res_proj weight, flattened.
        norm_weight: [D] the res_norm weight.
        eps: RMS epsilon of the keys.
        delta: [M, D], the layer's output to add to the running sum first (the graph's residual add, fused into
            this op by the build: `residual` = 1), rounded to partial.dtype as the add would be.
        out_norm: [D], the weight of the RMSNorm that reads the output (fused into this op by the build: `norm`
            = 1), applied to the output; the running sum stays as it is.
        out_eps: that RMSNorm's epsilon.

    Returns:
        [M, D] in partial.dtype: Σ_i softmax_i(score) · v_i; `partial` itself when K == 0. With out_norm:
        rms_norm(that, out_norm, eps=out_eps), in the dtype rms_norm gives. With delta: (that, the new running
        sum partial + delta).
    """
    if out_norm is not None:
        mixed = attn_res(partial, blocks, proj, norm_weight, eps=eps, delta=delta)
        if delta is None:
            return rms_norm(mixed, out_norm, eps=out_eps)
        return rms_norm(mixed[0], out_norm, eps=out_eps), mixed[1]
    if delta is not None:
        if delta.shape != partial.shape:
            raise ValueError(f"attn_res: delta must match partial {tuple(partial.shape)}, got {tuple(delta.shape)}")
        partial = partial + delta
        return attn_res(partial, blocks, proj, norm_weight, eps=eps), partial
    if partial.dim() != 2:
        raise ValueError(f"attn_res: partial must be [M, D], got {tuple(partial.shape)}")
    M, D = partial.shape
    if not isinstance(blocks, torch.Tensor):
        blocks = torch.stack(list(blocks)) if len(blocks) else partial.new_empty(0, M, D)
    if blocks.dim() != 3 or tuple(blocks.shape[1:]) != (M, D):
        raise ValueError(f"attn_res: blocks must be [K, {M}, {D}], got {tuple(blocks.shape)}")
    if proj.numel() != D or norm_weight.shape != (D,):
        raise ValueError(f"attn_res: proj ({tuple(proj.shape)}) and norm_weight ({tuple(norm_weight.shape)}) "
                         f"must both hold {D} values")
    if blocks.shape[0] == 0:
        # A softmax over one candidate is exactly 1: the identity.
        return partial
    cand = torch.cat([blocks.float(), partial.float()[None]], dim=0)              # [K+1, M, D]
    keys = cand * torch.rsqrt(cand.pow(2).mean(-1, keepdim=True) + eps)         # [K+1, M, D]
    query = norm_weight.float() * proj.float().reshape(D)                       # [D]
    probs = torch.softmax(keys @ query, dim=0)                                  # [K+1, M]
    return (probs[..., None] * cand).sum(0).to(partial.dtype)
