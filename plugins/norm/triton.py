"""RMSNorm in one Triton kernel, same signature and semantics as `reference.rms_norm`: a row a program, the
normalisation in fp32, rounded to x's dtype before the weight is applied (as HF does), the result in torch's
promotion of the two dtypes. The reference's five elementwise/reduction launches become one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3plugins.pdl import pdl, pdl_prologue


@triton.jit
def rms_norm_row(x, w_ptr, offs, mask, D, eps, DTYPE: tl.constexpr):
    """A whole row x in fp32 (values of DTYPE, masked lanes 0) -> w · (x · rsqrt(mean(x²) + eps)) in fp32, the
    normalised values rounded to DTYPE before the weight (as HF). Also AttnRes's fused norm (attn_res/triton.py)."""
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    y = y.to(DTYPE).to(tl.float32)
    return tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * y


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_out, eps, BD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = rms_norm_row(x, w_ptr, offs, mask, D, eps, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def row_warps(block: int) -> int:
    """Warps of a program that normalises a row of `block` values. Kernels that fuse the norm (the MLA cache write)
    launch with the same count, so the sum of squares adds in the same order and rounds to the same bits."""
    return min(16, max(1, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """See reference.rms_norm. x: [..., D]; weight: [D]."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm (triton): weight has shape {tuple(weight.shape)}, expected ({D},)")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        bd = triton.next_power_of_2(D)
        rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, D, x2.stride(0), out.stride(0), float(eps),
                                        BD=bd, num_warps=row_warps(bd), **pdl(x2))
    return out.reshape(x.shape)
