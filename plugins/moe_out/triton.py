"""The latent MoE's output projection on a GPU (reference.moe_out_proj's semantics): one Triton launch builds the
GEMM's input, [ norm(y) columns | glu(shared_h) ], a row a program; then one BLAS GEMM in the activation dtype. The
two-GEMM form it replaces was five launches (cast, norm, up-projection, GLU, down-projection) and an add."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3plugins.embed.dense import dense
from k3plugins.mlp.triton import ACT_IDS, glu_act
from k3plugins.moe_out.reference import check_shapes
from k3plugins.pdl import pdl, pdl_prologue


@triton.jit
def moe_out_input_kernel(y_ptr, nw_ptr, h_ptr, out_ptr, Dl, start, size, inter, stride_y, stride_h, stride_out, eps,
                         beta, linear_beta, HAS_NORM: tl.constexpr, ACT: tl.constexpr, BD: tl.constexpr,
                         BS: tl.constexpr, BI: tl.constexpr, PDL: tl.constexpr = False):
    """out[row] = [norm(y[row])[start:start+size] | act(h[row, :inter], h[row, inter:])] in out's dtype. y is
    rounded to out's dtype first (the reference's cast), the norm in fp32 rounded before its weight (as RMSNorm)."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    cols = tl.arange(0, BS)
    c_mask = cols < size
    z = tl.load(y_ptr + row * stride_y + start + cols, mask=c_mask, other=0.0).to(dt).to(tl.float32)
    if HAS_NORM:
        offs = tl.arange(0, BD)
        y = tl.load(y_ptr + row * stride_y + offs, mask=offs < Dl, other=0.0).to(dt).to(tl.float32)
        z = (z * tl.rsqrt(tl.sum(y * y, 0) / Dl + eps)).to(dt).to(tl.float32)
        z = z * tl.load(nw_ptr + start + cols, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, z.to(dt), mask=c_mask)
    ic = tl.arange(0, BI)
    i_mask = ic < inter
    g = tl.load(h_ptr + row * stride_h + ic, mask=i_mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * stride_h + inter + ic, mask=i_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + size + ic, glu_act(g, u, beta, linear_beta, ACT).to(dt), mask=i_mask)


def gemm_input(y: torch.Tensor, norm_weight: torch.Tensor | None, shared_h: torch.Tensor, *, start: int, size: int,
               eps: float, act: str, beta: float, linear_beta: float) -> torch.Tensor:
    """reference.gemm_input in one launch."""
    if act not in ACT_IDS:
        raise ValueError(f"unknown MLP activation {act!r}; expected one of {tuple(ACT_IDS)}")
    T, Dl = y.shape
    inter = shared_h.shape[-1] // 2
    out = torch.empty(T, size + inter, dtype=shared_h.dtype, device=y.device)
    if T:
        bd = triton.next_power_of_2(Dl)
        moe_out_input_kernel[(T,)](y, norm_weight if norm_weight is not None else y, shared_h, out, Dl, start, size,
                                   inter, y.stride(0), shared_h.stride(0), out.stride(0), float(eps), float(beta),
                                   float(linear_beta), HAS_NORM=norm_weight is not None, ACT=ACT_IDS[act], BD=bd,
                                   BS=triton.next_power_of_2(size), BI=triton.next_power_of_2(inter),
                                   num_warps=min(8, max(1, bd // 512)), **pdl(y))
    return out


def moe_out_proj(y: torch.Tensor, norm_weight: torch.Tensor | None, shared_h: torch.Tensor, weight: torch.Tensor, *,
                 start: int, size: int, eps: float, act: str, beta: float = 4.0,
                 linear_beta: float = 25.0) -> torch.Tensor:
    """See reference.moe_out_proj."""
    check_shapes(y, norm_weight, shared_h, weight, start, size)
    if y.stride(-1) != 1 or shared_h.stride(-1) != 1:
        raise ValueError("moe_out_proj (triton): y and shared_h need unit column strides")
    x = gemm_input(y, norm_weight, shared_h, start=start, size=size, eps=eps, act=act, beta=beta,
                   linear_beta=linear_beta)
    return dense(x, weight.to(x.dtype))
