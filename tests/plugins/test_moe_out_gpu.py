"""The latent MoE's output projection on the GPU (its Triton input kernel, then cuBLAS) vs the reference, in bf16
(pytest -m gpu): a K3 TEP16 rank's shapes and small ragged ones."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3plugins.moe_out import reference as ref  # noqa: E402
from k3plugins.moe_out import triton as mo  # noqa: E402


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("T,dl,start,size,inter,d", [(1, 3584, 672, 224, 384, 7168), (64, 3584, 3360, 224, 384, 7168),
                                                     (300, 3584, 0, 3584, 192, 1024), (7, 96, 24, 40, 24, 64),
                                                     (0, 3584, 0, 224, 384, 7168)])
def test_moe_out_proj_matches_reference(T, dl, start, size, inter, d, norm):
    g = torch.Generator(device="cuda").manual_seed(T + size)
    y = torch.randn(T, dl, device="cuda", generator=g) * 3
    nw = (1 + 0.1 * torch.randn(dl, device="cuda", generator=g)).to(torch.bfloat16) if norm else None
    h = (torch.randn(T, dl + 2 * inter, device="cuda", generator=g) * 4).to(torch.bfloat16)[:, dl:]  # a column slice
    w = (torch.randn(d, size + inter, device="cuda", generator=g) * (size + inter) ** -0.5).to(torch.bfloat16)
    kw = dict(start=start, size=size, eps=1e-5, act="situ", beta=4.0, linear_beta=25.0)
    got, want = mo.moe_out_proj(y, nw, h, w, **kw), ref.moe_out_proj(y, nw, h, w, **kw)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape == (T, d)
    if T:
        assert _rel(mo.gemm_input(y, nw, h, **kw), ref.gemm_input(y, nw, h, **kw)) < 8e-3  # bf16 rounding
        assert _rel(got, want) < 1e-2
