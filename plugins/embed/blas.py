"""Linear and LM head as one GEMM in the activation dtype (cuBLAS / hipBLASLt accumulate in fp32).

The references upcast the weight to fp32 on every call: on a GPU that is a full copy of the weight plus an
fp32 SIMT GEMM, which a real-size rank measured at about a quarter of its decode step.
"""

import torch


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K], weight [N, K] -> [T, N] in x.dtype."""
    return x @ weight.to(x.dtype).T


def lm_head(h: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """h [T, D], weight [V_local, D], indices [N] (rows of h to score) -> fp32 logits [N, V_local]."""
    return (h.index_select(0, indices) @ weight.to(h.dtype).T).float()
