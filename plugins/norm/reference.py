"""RMSNorm as HF KimiRMSNorm computes it (K3_SPEC.md §2 notation)."""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim.

    Args:
        x: [..., D] activations, any float dtype.
        weight: [D] scale.
        eps: added to mean(x²) (1e-5 for K3 norms, 1e-6 for the MLA latent norms).

    Returns:
        [..., D]: weight * (x / rms(x)) with the normalisation in fp32, rounded to x.dtype before the
        weight is applied; the result dtype is torch's promotion of weight.dtype and x.dtype, as in HF.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},) "
                         f"to match the last dim of x {tuple(x.shape)}")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
