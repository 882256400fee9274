import pytest
import torch

from k3plugins.norm import rms_norm


def _naive(x, w, eps):
    x64 = x.double()
    return w.double() * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(63, 100), (1, 7), (3, 5, 64)], ids=["63x100", "1x7", "3x5x64"])
@pytest.mark.parametrize("eps", [1e-5, 1e-6], ids=["eps1e-5", "eps1e-6"])
def test_rms_norm_fp32(shape, eps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    y = rms_norm(x, w, eps=eps)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _naive(x, w, eps), rtol=1e-6, atol=1e-6)


def test_rms_norm_eps_matters_for_tiny_inputs():
    x = torch.full((2, 16), 1e-3)
    w = torch.ones(16)
    # mean(x²) = 1e-6, so eps 1e-6 vs 1e-5 changes the output by ~2.3x.
    ratio = rms_norm(x, w, eps=1e-6) / rms_norm(x, w, eps=1e-5)
    torch.testing.assert_close(ratio, torch.full_like(ratio, (11 / 2) ** 0.5))


def test_rms_norm_bf16_rounds_before_weight():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(63, 100, generator=g).bfloat16()
    w = (torch.rand(100, generator=g) + 0.5).bfloat16()
    y = rms_norm(x, w, eps=1e-5)
    assert y.dtype == torch.bfloat16
    xf = x.float()
    expect = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(y, expect)
    # An fp32 weight on bf16 activations promotes to fp32, as HF KimiRMSNorm does.
    assert rms_norm(x, w.float(), eps=1e-5).dtype == torch.float32


def test_rms_norm_rejects_wrong_weight():
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.ones(4, 8), torch.ones(7), eps=1e-5)
