"""Gated MLPs: SiTU-GLU (K3_SPEC.md §2.5) and SiLU-GLU (Kimi-Linear)."""
import torch
import torch.nn.functional as F

ACTS = ("situ", "silu")


def situ_glu(gate: torch.Tensor, up: torch.Tensor, *, beta: float, linear_beta: float) -> torch.Tensor:
    """beta·tanh(g/beta)·sigmoid(g) · linear_beta·tanh(u/linear_beta), fp32 math, out in gate.dtype.

    Args:
        gate: [..., I]; up: [..., I].
    """
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (a * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(g)·u, fp32 math, out in gate.dtype. gate, up: [..., I]."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, *, act: str, beta: float, linear_beta: float) -> torch.Tensor:
    """The GLU named by `act` ("situ" or "silu"); beta/linear_beta are used by SiTU only."""
    if act == "situ":
        return situ_glu(gate, up, beta=beta, linear_beta=linear_beta)
    if act == "silu":
        return silu_glu(gate, up)
    raise ValueError(f"unknown MLP activation {act!r}; expected one of {ACTS}")


def gated_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor | None, down_weight: torch.Tensor, *, act: str,
              beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """down(act(gate x, up x)) with fp32 matmuls.

    Args:
        x: [M, D], or [M, 2I] when gate_up_weight is None: the gate | up projection already made (the latent
            MoE's shared expert, whose gate/up rows share a GEMM with the latent down-projection).
        gate_up_weight: [2I, D], gate rows first, then up rows; or None.
        down_weight: [D, I].
        act: "situ" | "silu".

    Returns:
        [M, D] in x.dtype.
    """
    if gate_up_weight is None:
        D, inter = down_weight.shape[0], x.shape[-1] // 2
        if x.shape[-1] % 2 or tuple(down_weight.shape) != (D, inter):
            raise ValueError(f"gated_mlp: a projected x [M, 2I] needs down_weight [D, I]; got x {tuple(x.shape)}, "
                             f"down_weight {tuple(down_weight.shape)}")
        h = x.float()
    else:
        D = x.shape[-1]
        if gate_up_weight.dim() != 2 or gate_up_weight.shape[1] != D or gate_up_weight.shape[0] % 2:
            raise ValueError(f"gated_mlp: gate_up_weight must be [2I, {D}], got {tuple(gate_up_weight.shape)}")
        inter = gate_up_weight.shape[0] // 2
        if tuple(down_weight.shape) != (D, inter):
            raise ValueError(f"gated_mlp: down_weight must be [{D}, {inter}], got {tuple(down_weight.shape)}")
        h = x.float() @ gate_up_weight.float().T                                # [M, 2I]
    a = glu(h[:, :inter], h[:, inter:], act=act, beta=beta, linear_beta=linear_beta)
    return (a @ down_weight.float().T).to(x.dtype)
