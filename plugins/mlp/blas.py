"""Gated MLP with its two GEMMs in the activation dtype (fp32 accumulation in the BLAS), the GLU in fp32.

Same signature and semantics as reference.gated_mlp, without the reference's per-call fp32 copy of both
weights (see plugins/embed/blas.py). On a GPU the GLU is one Triton launch (mlp/triton.py).
"""

import torch

from k3plugins.embed.dense import dense
from k3plugins.mlp import reference


def gated_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor | None, down_weight: torch.Tensor, *, act: str,
              beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """down(act(gate x, up x)); x [M, D], gate_up_weight [2I, D] (gate rows first), down_weight [D, I]; or x
    [M, 2I] already projected and gate_up_weight None (reference.gated_mlp)."""
    h = x if gate_up_weight is None else dense(x, gate_up_weight.to(x.dtype))   # [M, 2I]
    inter = h.shape[-1] // 2
    if h.is_cuda:
        from k3plugins.mlp.triton import glu
        a = glu(h, act=act, beta=beta, linear_beta=linear_beta)
    else:
        a = reference.glu(h[:, :inter], h[:, inter:], act=act, beta=beta, linear_beta=linear_beta)
    return dense(a, down_weight.to(x.dtype))
