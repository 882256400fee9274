"""The plugins' dense GEMMs (x @ wᵀ) in the activation dtype: the one place they all go through (MoEInProj's fp32-out
GEMM is its own, moe_in/triton.py)."""

import torch


def dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ -> [M, N] in x's dtype (torch's matmul)."""
    return x @ weight.T
