"""The latent MoE's output projection (MoEOutProj): one GEMM over [norm(y) columns | glu(shared_h)] equals the
latent up-projection plus the shared expert's down-projection, and bad shapes are refused by name."""
import pytest
import torch

from k3plugins.mlp.reference import gated_mlp
from k3plugins.moe_out.reference import moe_out_proj
from k3plugins.norm.reference import rms_norm

KW = dict(eps=1e-5, act="situ", beta=4.0, linear_beta=25.0)


def _inputs(T=6, dl=48, inter=16, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, dl, generator=g), 1 + 0.1 * torch.randn(dl, generator=g),
            torch.randn(T, 2 * inter, generator=g) * 4, torch.randn(d, dl, generator=g) * 0.1,
            torch.randn(d, inter, generator=g) * 0.1)


@pytest.mark.parametrize("tp_rank,tp", [(0, 1), (1, 2), (2, 3)])
@pytest.mark.parametrize("norm", [True, False])
def test_one_gemm_equals_up_plus_shared_down(tp_rank, tp, norm):
    """fp32: the sum over TP ranks of each rank's column slice is the whole up-projection plus the shared down."""
    y, nw, h, up, down = _inputs()
    width = y.shape[1] // tp
    start = tp_rank * width
    w = torch.cat([up[:, start:start + width], down], 1)
    got = moe_out_proj(y, nw if norm else None, h, w, start=start, size=width, **KW)
    z = rms_norm(y, nw, eps=KW["eps"]) if norm else y
    want = z[:, start:start + width] @ up[:, start:start + width].T + gated_mlp(h, None, down, act="situ")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_rounds_once():
    """In bf16 the one GEMM rounds once; the two-GEMM form rounds each product and their sum. Both stay within
    bf16 rounding of the fp32 result."""
    y, nw, h, up, down = _inputs(T=64, dl=256, inter=64, d=128, seed=1)
    exact = moe_out_proj(y, nw, h, torch.cat([up, down], 1), start=0, size=256, **KW)
    got = moe_out_proj(y, nw.bfloat16(), h.bfloat16(), torch.cat([up, down], 1).bfloat16(), start=0, size=256, **KW)
    yb = rms_norm(y.bfloat16(), nw.bfloat16(), eps=KW["eps"])
    two = (yb.float() @ up.bfloat16().float().T).bfloat16() + gated_mlp(h.bfloat16(), None, down.bfloat16(),
                                                                         act="situ")
    assert got.dtype == torch.bfloat16
    err_one, err_two = (((form.float() - exact).norm() / exact.norm()).item() for form in (got, two))
    assert err_two < 1e-2
    assert err_one < err_two  # one rounding less (3.4e-3 against 3.5e-3 with this seed)


@pytest.mark.parametrize("change,match", [
    (dict(h=torch.zeros(6, 31)), r"shared_h must be \[6, 2I\]"),
    (dict(start=40), r"latent columns \[40, 88\) are outside y's 48"),
    (dict(nw=torch.ones(47)), r"norm_weight must be \[48\]"),
    (dict(w=torch.zeros(32, 47)), r"weight must be \[D, 48 \+ 16\]"),
])
def test_bad_shapes_are_named(change, match):
    y, nw, h, up, down = _inputs()
    args = dict(y=y, nw=nw, h=h, w=torch.cat([up, down], 1), start=0)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        moe_out_proj(args["y"], args["nw"], args["h"], args["w"], start=args["start"], size=48, **KW)
