import pytest
import torch

from k3plugins.mlp import gated_mlp, silu_glu, situ_glu


def _situ64(g, u, beta, lb):
    g, u = g.double(), u.double()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lb * torch.tanh(u / lb)


def _naive_mlp(x, gu, down, act, beta=4.0, lb=25.0):
    inter = gu.shape[0] // 2
    g = x.double() @ gu[:inter].double().T
    u = x.double() @ gu[inter:].double().T
    a = _situ64(g, u, beta, lb) if act == "situ" else g * torch.sigmoid(g) * u
    return a @ down.double().T


def test_situ_glu_matches_formula_and_saturates():
    g = torch.linspace(-60, 60, 1001)
    u = torch.linspace(-200, 200, 1001).flip(0)
    y = situ_glu(g, u, beta=4.0, linear_beta=25.0)
    torch.testing.assert_close(y.double(), _situ64(g, u, 4.0, 25.0), rtol=1e-6, atol=1e-5)
    # Both sides are bounded: |gate side| < beta, |up side| < linear_beta.
    assert y.abs().max() <= 4.0 * 25.0
    assert not torch.equal(y, situ_glu(g, u, beta=2.0, linear_beta=25.0))


def test_silu_glu_and_bf16_output_dtype():
    g = torch.randn(63, 100, generator=torch.Generator().manual_seed(0))
    u = torch.randn(63, 100, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(silu_glu(g, u), torch.nn.functional.silu(g) * u)
    assert situ_glu(g.bfloat16(), u.bfloat16(), beta=4.0, linear_beta=25.0).dtype == torch.bfloat16


@pytest.mark.parametrize("M,D,I", [(63, 100, 72), (1, 64, 256), (100, 48, 30)], ids=["M63", "M1", "M100"])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_gated_mlp_fp32(M, D, I, act):
    g = torch.Generator().manual_seed(M * 7 + D)
    x = torch.randn(M, D, generator=g) * 2
    gu = torch.randn(2 * I, D, generator=g) / D**0.5 * 3
    down = torch.randn(D, I, generator=g) / I**0.5
    out = gated_mlp(x, gu, down, act=act)
    assert out.dtype == torch.float32 and out.shape == (M, D)
    torch.testing.assert_close(out.double(), _naive_mlp(x, gu, down, act), rtol=1e-5, atol=1e-4)


def test_gated_mlp_gate_rows_first():
    g = torch.Generator().manual_seed(5)
    x, gu, down = torch.randn(9, 16, generator=g), torch.randn(40, 16, generator=g), torch.randn(16, 20, generator=g)
    swapped = torch.cat([gu[20:], gu[:20]])
    assert not torch.allclose(gated_mlp(x, gu, down, act="situ"), gated_mlp(x, swapped, down, act="situ"))


def test_gated_mlp_bf16_smoke():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(100, 64, generator=g).bfloat16()
    gu = (torch.randn(96, 64, generator=g) / 8).bfloat16()
    down = (torch.randn(64, 48, generator=g) / 7).bfloat16()
    out = gated_mlp(x, gu, down, act="situ", beta=4.0, linear_beta=25.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _naive_mlp(x, gu, down, "situ"), rtol=2e-2, atol=2e-2)


def test_gated_mlp_takes_a_projected_input():
    """gate_up_weight None: x is the gate | up projection already (a column slice of the latent MoE's fused input
    GEMM, so strided): the same as projecting inside."""
    g = torch.Generator().manual_seed(3)
    x, gu, down = torch.randn(7, 24, generator=g), torch.randn(40, 24, generator=g) / 5, torch.randn(24, 20, generator=g)
    wide = x @ torch.cat([torch.randn(6, 24, generator=g), gu]).T                 # [7, 6 + 40]: other columns first
    projected = wide[:, 6:]
    assert not projected.is_contiguous()
    torch.testing.assert_close(gated_mlp(projected, None, down, act="situ"), gated_mlp(x, gu, down, act="situ"))
    with pytest.raises(ValueError, match="projected x"):
        gated_mlp(projected[:, :39], None, down, act="situ")


def test_gated_mlp_rejects_bad_input():
    with pytest.raises(ValueError, match="down_weight must be"):
        gated_mlp(torch.ones(2, 8), torch.ones(10, 8), torch.ones(8, 4), act="situ")
    with pytest.raises(ValueError, match="unknown MLP activation 'gelu'"):
        gated_mlp(torch.ones(2, 8), torch.ones(10, 8), torch.ones(8, 5), act="gelu")
