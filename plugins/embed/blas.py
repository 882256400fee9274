"""Linear and LM head as one GEMM in the activation dtype (cuBLAS / hipBLASLt accumulate in fp32).

The references upcast the weight to fp32 on every call: on a GPU that is a full copy of the weight plus an
fp32 SIMT GEMM, which a real-size rank measured at about a quarter of its decode step.
"""

import torch

from k3plugins.embed.dense import dense


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K], weight [N, K] -> [T, N] in x.dtype."""
    return dense(x, weight.to(x.dtype))


def lm_head(h: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """h [T, D], weight [V_local, D], indices [N] (rows of h to score) -> fp32 logits [N, V_local]."""
    return dense(h.index_select(0, indices), weight.to(h.dtype)).float()
