"""MoEInProj's reference: the in_proj GEMM with the router's rows last, against the Linear and Router references
on the same rows, and its errors."""
import pytest
import torch

from k3plugins.embed.reference import linear
from k3plugins.moe_in import moe_in_proj
from k3plugins.router.reference import route

KW = dict(top_k=4, renormalize=True, scaling_factor=2.5)


def _case(T=9, D=48, N=40, E=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    w = (torch.randn(N + E, D, generator=g) * D ** -0.5).to(dtype)
    bias = torch.randn(E, generator=g) * 0.1
    return x, w, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_linear_then_route(dtype):
    x, w, bias = _case(dtype=dtype)
    ids, wts, zh = moe_in_proj(x, w, bias, num_experts=16, **KW)
    ids_r, wts_r = route(x, w[40:], bias, **KW)
    assert torch.equal(ids, ids_r) and ids.dtype == torch.int64
    torch.testing.assert_close(wts, wts_r, rtol=1e-6, atol=1e-7)
    assert zh.dtype == dtype and zh.shape == (9, 40)
    torch.testing.assert_close(zh, linear(x, w[:40]), rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-6)


def test_no_tokens():
    x, w, bias = _case(T=0)
    ids, wts, zh = moe_in_proj(x, w, bias, num_experts=16, **KW)
    assert ids.shape == (0, 4) and wts.shape == (0, 4) and zh.shape == (0, 40)


@pytest.mark.parametrize("bad,match", [("weight_rows", r"weight must be \[N \+ 16, 48\]"),
                                       ("weight_cols", r"weight must be \[N \+ 16, 48\]"),
                                       ("bias", r"correction_bias must be \[16\]")])
def test_errors_name_the_input(bad, match):
    x, w, bias = _case()
    if bad == "weight_rows":
        w = w[:16]
    elif bad == "weight_cols":
        w = w[:, :40]
    else:
        bias = bias[:8]
    with pytest.raises(ValueError, match=match):
        moe_in_proj(x, w, bias, num_experts=16, **KW)
