"""The plugins' dense GEMMs (x @ wᵀ) in one place, so that an experiment can swap the kernel under all of them.

`use_skinny()` routes decode-sized ones through the experimental Triton kernel of skinny_gemm.py for the rest of
the process. It is an experiment switch (`tools/bench_rank.py --skinny`), not an engine setting: no engine turns
it on, and without it this module needs nothing but torch.
"""

import torch

_SKINNY = False


def use_skinny(on: bool = True) -> None:
    global _SKINNY
    _SKINNY = on


def dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ -> [M, N] in x's dtype: torch's matmul, or, after use_skinny(), skinny_linear for
    a CUDA x of at most MAX_M rows in the weight's dtype."""
    if _SKINNY and x.is_cuda and x.dim() == 2 and weight.dtype == x.dtype and weight.stride(1) == 1:
        from k3plugins.embed.skinny_gemm import MAX_M, skinny_linear
        if x.shape[0] <= MAX_M:
            return skinny_linear(x, weight)
    return x @ weight.T
