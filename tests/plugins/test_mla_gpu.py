"""Triton MLA paged decode attention vs its definition on the GPU (pytest -m gpu)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3plugins.mla.triton import mla_decode_attention  # noqa: E402


def _ref(ql, qp, kv, pt, lens, scale):
    out = []
    for b in range(ql.shape[0]):
        toks = kv[pt[b].long()].reshape(-1, 576)[: int(lens[b])].double()
        s = (ql[b].double() @ toks[:, :512].T + qp[b].double() @ toks[:, 512:].T) * scale
        out.append(torch.softmax(s, -1) @ toks[:, :512])
    return torch.stack(out)


@pytest.mark.parametrize("H", [1, 16, 96])
@pytest.mark.parametrize("lens", [[1], [64], [65, 1, 300], [4096, 17, 2000, 128]], ids=str)
@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.parametrize("block_h", [16, 64])
def test_mla_decode_matches_definition(H, lens, splits, block_h):
    if block_h == 64 and H != 96:
        pytest.skip("block_h=64 is the 96-head config")
    g = torch.Generator(device="cuda").manual_seed(len(lens) * 100 + H)
    B = len(lens)
    max_pages = (max(lens) + 63) // 64
    num_pages = B * max_pages + 3
    kv = torch.randn(num_pages, 64, 576, device="cuda", generator=g).to(torch.bfloat16)
    pt = torch.randperm(num_pages, device="cuda", generator=g)[: B * max_pages].view(B, max_pages).int()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ql = torch.randn(B, H, 512, device="cuda", generator=g).to(torch.bfloat16)
    qp = torch.randn(B, H, 64, device="cuda", generator=g).to(torch.bfloat16)
    out = mla_decode_attention(ql, qp, kv, pt, lens_t, scale=192 ** -0.5, num_splits=splits, block_h=block_h)
    ref = _ref(ql, qp, kv, pt, lens_t, 192 ** -0.5)
    assert out.shape == (B, H, 512) and torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
