"""The latent MoE's input projection on a GPU (reference.moe_in_proj's semantics): one BLAS GEMM with fp32 output
(torch.mm's out_dtype: bf16/fp16 operands, fp32 accumulation, as the Triton router's logits kernel had), then the
router's top-k launch, which also rounds the rest of each row to the activation dtype.

On ROCm torch's bf16 -> fp32 GEMM is not supported by every BLAS backend and has not run here, so there the two
row blocks go as before the op: the activation-dtype GEMM on the in_proj rows and the Triton router (its own fp32
logits kernel) on the router's rows."""

from __future__ import annotations

import torch

from k3plugins.embed.dense import dense
from k3plugins.moe_in.reference import check_shapes
from k3plugins.router import triton as router


def fp32_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K]ᵀ -> fp32 [T, N]: cuBLAS on CUDA; on the CPU (Triton's interpreter, in the tests)
    in fp32."""
    if x.is_cuda:
        return torch.mm(x, weight.t(), torch.float32)
    return x.float() @ weight.float().T


def moe_in_proj(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, *, num_experts: int,
                top_k: int, renormalize: bool, scaling_factor: float, num_expert_group: int = 1,
                topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See reference.moe_in_proj."""
    n = check_shapes(x, weight, correction_bias, num_experts)
    ok, why = router.selection_fits(num_experts, top_k, num_expert_group, topk_group)
    if not ok:
        raise ValueError(f"moe_in_proj (triton): {why}")
    routing = dict(top_k=top_k, renormalize=renormalize, scaling_factor=scaling_factor)
    if x.is_cuda and torch.version.hip:
        ids, wts = router.route(x, weight[n:], correction_bias, **routing)
        return ids, wts, dense(x, weight[:n])
    h = fp32_gemm(x, weight)
    zh = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    ids, wts = router.select_experts(h[:, n:], correction_bias, cast=(h, zh), **routing)
    return ids, wts, zh
