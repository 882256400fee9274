import pytest
import torch

from k3plugins.attn_res import attn_res
from k3plugins.norm.reference import rms_norm


def _naive(partial, blocks, proj, norm_weight, eps):
    """fp64, written as the spec reads: score_i = RMSNorm(v_i; w_n) · w_p, loop over candidates."""
    cands = [b.double() for b in blocks] + [partial.double()]
    scores = []
    for v in cands:
        normed = norm_weight.double() * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        scores.append(normed @ proj.double().reshape(-1))
    probs = torch.softmax(torch.stack(scores, -1), -1)                          # [M, K+1]
    return sum(probs[:, i : i + 1] * v for i, v in enumerate(cands))


def _inputs(M, K, D, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    partial = (torch.randn(M, D, generator=g) * 2).to(dtype)
    # Snapshots of different magnitudes: the keys are normalised, the mixed values are not.
    blocks = (torch.randn(K, M, D, generator=g) * torch.linspace(0.5, 4, max(K, 1))[:K, None, None]).to(dtype)
    proj = (torch.randn(1, D, generator=g) * scale / D**0.5).to(dtype)
    norm_weight = (torch.rand(D, generator=g) + 0.5).to(dtype)
    return partial, blocks, proj, norm_weight


@pytest.mark.parametrize("M,K,D", [(64, 1, 96), (100, 3, 128), (63, 5, 100), (7, 11, 72)],
                         ids=["M64-K1", "M100-K3", "M63-K5", "M7-K11"])
@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["soft", "peaked"])
def test_attn_res_fp32(M, K, D, scale):
    partial, blocks, proj, nw = _inputs(M, K, D, torch.float32, seed=M + K, scale=scale)
    out = attn_res(partial, blocks, proj.reshape(-1), nw, eps=1e-5)
    assert out.dtype == torch.float32 and out.shape == (M, D)
    torch.testing.assert_close(out.double(), _naive(partial, blocks, proj, nw, 1e-5), rtol=1e-5, atol=1e-5)


def test_attn_res_no_blocks_is_identity():
    partial, _, proj, nw = _inputs(63, 0, 100, torch.float32, seed=0)
    out = attn_res(partial, torch.empty(0, 63, 100), proj.reshape(-1), nw, eps=1e-5)
    assert torch.equal(out, partial)


def test_attn_res_equal_candidates_average():
    # Identical keys give uniform weights, so the output is the mean of the raw candidates.
    v = torch.randn(5, 32)
    blocks = torch.stack([v * 2, v * 3])
    out = attn_res(v, blocks, torch.randn(32), torch.ones(32), eps=0.0)
    torch.testing.assert_close(out, v * 2, rtol=1e-5, atol=1e-5)


def test_attn_res_bf16_smoke():
    partial, blocks, proj, nw = _inputs(100, 3, 128, torch.bfloat16, seed=3)
    out = attn_res(partial, blocks, proj.reshape(-1), nw, eps=1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _naive(partial, blocks, proj, nw, 1e-5), rtol=2e-2, atol=2e-2)


def test_attn_res_rejects_bad_shapes():
    with pytest.raises(ValueError, match="blocks must be"):
        attn_res(torch.ones(4, 8), torch.ones(2, 3, 8), torch.ones(8), torch.ones(8), eps=1e-5)
    with pytest.raises(ValueError, match="must both hold 8"):
        attn_res(torch.ones(4, 8), torch.ones(2, 4, 8), torch.ones(7), torch.ones(8), eps=1e-5)


def test_attn_res_delta_is_the_add_then_the_mix():
    """delta (the graph's residual add fused into the op): the output of the mix over partial + delta, and that sum
    itself, rounded as the separate add rounded it."""
    partial, blocks, proj, nw = _inputs(9, 3, 64, torch.bfloat16, seed=4)
    delta = torch.randn(9, 64).to(torch.bfloat16)
    out, total = attn_res(partial, blocks, proj.reshape(-1), nw, eps=1e-5, delta=delta)
    assert torch.equal(total, partial + delta)
    assert torch.equal(out, attn_res(partial + delta, blocks, proj.reshape(-1), nw, eps=1e-5))
    with pytest.raises(ValueError, match="delta must match"):
        attn_res(partial, blocks, proj.reshape(-1), nw, eps=1e-5, delta=delta[:3])


@pytest.mark.parametrize("K", [0, 3], ids=["K0", "K3"])
@pytest.mark.parametrize("fused_add", [False, True], ids=["plain", "delta"])
def test_attn_res_out_norm_is_the_mix_then_rms_norm(K, fused_add):
    """out_norm (the next RMSNorm fused into the op): exactly rms_norm of the output without it, in rms_norm's dtype
    (fp32 weight on bf16 activations: fp32); the running sum is not normed. K = 0: the norm of the sum itself."""
    partial, blocks, proj, nw = _inputs(9, K, 64, torch.bfloat16, seed=5)
    delta = torch.randn(9, 64).to(torch.bfloat16) if fused_add else None
    weight = torch.rand(64) + 0.5
    got = attn_res(partial, blocks, proj.reshape(-1), nw, eps=1e-5, delta=delta, out_norm=weight, out_eps=1e-6)
    mixed = attn_res(partial, blocks, proj.reshape(-1), nw, eps=1e-5, delta=delta)
    if fused_add:
        (got, total), (mixed, want_total) = got, mixed
        assert torch.equal(total, want_total) and torch.equal(total, partial + delta)
    want = rms_norm(mixed, weight, eps=1e-6)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if K == 0:
        assert torch.equal(got, rms_norm(partial + delta if fused_add else partial, weight, eps=1e-6))
    else:  # the norm is applied: not the mix itself
        assert not torch.allclose(got, mixed.float(), atol=1e-2)
