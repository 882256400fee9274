"""The plugins' dense GEMMs (x @ wᵀ): the one place they all go through."""

import torch


def dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ -> [M, N] in x's dtype (torch's matmul)."""
    return x @ weight.T
