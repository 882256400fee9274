"""The latent MoE's input projection with the router's logits as its last columns (K3_SPEC.md §2.4).

    h = x @ [ routed_expert_down_proj | shared gate | shared up | router gate ]ᵀ     fp32, [T, N + E]
    ids, weights = router.select_experts(h[:, N:])   sigmoid, bias for selection, top-k, renormalise
    zh = h[:, :N] in x's dtype                       the latent z and the shared expert's gate | up (graph.py splits)

The router and the in_proj read the same normed hidden state, so one GEMM reads x once and the router's weights
(896 × 7168 on K3) ride along the in_proj's. The router wants fp32 logits; the GEMM gives its whole row in fp32,
and the rest is rounded to the activation dtype where the router's top-k runs. On the H200 this is one cuBLAS
GEMM and one small launch instead of a GEMM and the router's two launches (BENCHMARKS.md, twenty-first session).
"""

import torch

from k3plugins.router.reference import select_experts


def check_shapes(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None,
                 num_experts: int) -> int:
    """N, the width of zh, after checking that the inputs fit one another."""
    if x.dim() != 2:
        raise ValueError(f"moe_in_proj: x must be [T, D], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] <= num_experts:
        raise ValueError(f"moe_in_proj: weight must be [N + {num_experts}, {x.shape[1]}] (in_proj rows, then the "
                         f"router's), got {tuple(weight.shape)}")
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"moe_in_proj: correction_bias must be [{num_experts}], got {tuple(correction_bias.shape)}")
    return weight.shape[0] - num_experts


def moe_in_proj(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, *, num_experts: int,
                top_k: int, renormalize: bool, scaling_factor: float, num_expert_group: int = 1,
                topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Args:
        x: [T, D] normed hidden states (activation dtype).
        weight: [N + E, D]: the in_proj rows (latent down-projection, shared gate, shared up), then the router's.
        correction_bias, top_k, renormalize, scaling_factor, num_expert_group, topk_group: as router.route.

    Returns:
        (topk_ids int64 [T, top_k], topk_weights fp32 [T, top_k], zh [T, N] in x's dtype).
    """
    n = check_shapes(x, weight, correction_bias, num_experts)
    h = x.float() @ weight.float().T
    ids, wts = select_experts(h[:, n:], correction_bias, top_k=top_k, renormalize=renormalize,
                              scaling_factor=scaling_factor, num_expert_group=num_expert_group, topk_group=topk_group)
    return ids, wts, h[:, :n].to(x.dtype)
