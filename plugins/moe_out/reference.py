"""The latent MoE's output projection: the routed experts' latent up-projection and the shared expert's
down-projection as one GEMM over their inputs side by side (K3_SPEC.md §2.4).

    out = [ norm(y)[:, start:start+size] | glu(shared_h) ] @ [ up_proj[:, start:start+size] | shared.down ]ᵀ

which is up_proj(norm(y)) + shared.down(glu(shared_h)) restricted to this rank's columns of the latent (the TP
partial sums an all-reduce adds up afterwards). One GEMM instead of two plus their add: on a real-size rank these
are small GEMMs whose time is launch and latency, not bytes (BENCHMARKS.md). Both sums accumulate in one fp32
accumulator and round once; the two-GEMM form rounded each product and their sum.
"""

import torch

from k3plugins.mlp.reference import glu
from k3plugins.norm.reference import rms_norm


def check_shapes(y: torch.Tensor, norm_weight: torch.Tensor | None, shared_h: torch.Tensor, weight: torch.Tensor,
                 start: int, size: int) -> int:
    """The shared expert's width I, after checking that the inputs fit one another."""
    T, Dl = y.shape
    inter = shared_h.shape[-1] // 2
    if shared_h.dim() != 2 or shared_h.shape[0] != T or shared_h.shape[-1] % 2:
        raise ValueError(f"moe_out_proj: shared_h must be [{T}, 2I] (gate | up), got {tuple(shared_h.shape)}")
    if start < 0 or size <= 0 or start + size > Dl:
        raise ValueError(f"moe_out_proj: latent columns [{start}, {start + size}) are outside y's {Dl}")
    if norm_weight is not None and tuple(norm_weight.shape) != (Dl,):
        raise ValueError(f"moe_out_proj: norm_weight must be [{Dl}], got {tuple(norm_weight.shape)}")
    if weight.dim() != 2 or weight.shape[1] != size + inter:
        raise ValueError(f"moe_out_proj: weight must be [D, {size} + {inter}] (up_proj columns | shared down), got "
                         f"{tuple(weight.shape)}")
    return inter


def gemm_input(y: torch.Tensor, norm_weight: torch.Tensor | None, shared_h: torch.Tensor, *, start: int, size: int,
               eps: float, act: str, beta: float, linear_beta: float) -> torch.Tensor:
    """[T, size + I] in shared_h's dtype: the normalised latent's columns, then the shared expert's activation."""
    inter = shared_h.shape[-1] // 2
    z = y.to(shared_h.dtype)  # the experts' fp32 sum in the activation dtype, as the norm sees it
    if norm_weight is not None:
        z = rms_norm(z, norm_weight, eps=eps)
    a = glu(shared_h[:, :inter], shared_h[:, inter:], act=act, beta=beta, linear_beta=linear_beta)
    return torch.cat([z[:, start:start + size].to(shared_h.dtype), a], dim=-1)


def moe_out_proj(y: torch.Tensor, norm_weight: torch.Tensor | None, shared_h: torch.Tensor, weight: torch.Tensor, *,
                 start: int, size: int, eps: float, act: str, beta: float = 4.0,
                 linear_beta: float = 25.0) -> torch.Tensor:
    """Args:
        y: [T, Dl] fp32, the routed experts' sum in latent space.
        norm_weight: [Dl], the latent RMSNorm's weight, or None (no latent norm).
        shared_h: [T, 2I], the shared expert's gate | up projection (activation dtype).
        weight: [D, size + I]: this rank's columns of the latent up-projection, then the shared expert's down.
        start, size: this rank's columns of the latent.

    Returns:
        [T, D] in shared_h's dtype, fp32 matmul.
    """
    check_shapes(y, norm_weight, shared_h, weight, start, size)
    x = gemm_input(y, norm_weight, shared_h, start=start, size=size, eps=eps, act=act, beta=beta,
                   linear_beta=linear_beta)
    return (x.float() @ weight.float().T).to(shared_h.dtype)
