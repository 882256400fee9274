"""The GLU of a gated MLP in one Triton launch: out = act(gate, up) from the gate|up GEMM's output, fp32 math.

The torch GLU (reference.glu) is about ten elementwise launches a call (casts, the two tanh, sigmoid, products);
in a decode step of a real-size rank that is ~2 ms of small kernels over the dense and shared-expert MLPs. The
MoE kernels fuse the same activation into their gate/up epilogue (`glu_act`).
"""

import torch
import triton
import triton.language as tl

from k3plugins.pdl import pdl, pdl_prologue

ACT_IDS = {"situ": 0, "silu": 1}


@triton.jit
def _tanh(x):
    # no portable tl.tanh: tanh(x) = 2·sigmoid(2x) − 1
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def glu_act(g, u, beta, linear_beta, ACT: tl.constexpr):
    """fp32 gate/up -> SiTU (ACT 0: beta·tanh(g/beta)·sigmoid(g)·linear_beta·tanh(u/linear_beta)) or SiLU-GLU (1)."""
    if ACT == 0:
        a = beta * _tanh(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
    else:
        a = g * tl.sigmoid(g) * u
    return a


@triton.jit
def glu_kernel(h_ptr, out_ptr, inter, stride_h, stride_out, beta, linear_beta, ACT: tl.constexpr, BI: tl.constexpr,
               PDL: tl.constexpr = False):
    """out[m, i] = act(h[m, i], h[m, inter + i]); one row and BI columns a program."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = cols < inter
    g = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * stride_h + inter + cols, mask=mask, other=0.0).to(tl.float32)
    a = glu_act(g, u, beta, linear_beta, ACT)
    tl.store(out_ptr + row * stride_out + cols, a.to(out_ptr.dtype.element_ty), mask=mask)


def glu(h: torch.Tensor, *, act: str, beta: float, linear_beta: float) -> torch.Tensor:
    """h [M, 2I] (gate columns, then up) -> [M, I] in h.dtype; reference.glu's semantics."""
    if act not in ACT_IDS:
        raise ValueError(f"unknown MLP activation {act!r}; expected one of {tuple(ACT_IDS)}")
    M, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(M, inter, dtype=h.dtype, device=h.device)
    if M and inter:
        bi = min(1024, triton.next_power_of_2(inter))
        glu_kernel[(M, triton.cdiv(inter, bi))](h, out, inter, h.stride(0), out.stride(0), float(beta),
                                                float(linear_beta), ACT=ACT_IDS[act], BI=bi, num_warps=4, **pdl(h))
    return out
