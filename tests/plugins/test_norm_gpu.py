"""Triton RMSNorm, AttnRes, the MLP GLU and the MoE pair sort vs their torch references on the GPU, in bf16
(pytest -m gpu)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3plugins.attn_res import reference as ar_ref  # noqa: E402
from k3plugins.attn_res import triton as ar  # noqa: E402
from k3plugins.mlp import reference as mlp_ref  # noqa: E402
from k3plugins.mlp import triton as mlp  # noqa: E402
from k3plugins.moe.triton import sort_pairs  # noqa: E402
from k3plugins.norm import reference as norm_ref  # noqa: E402
from k3plugins.norm import triton as norm  # noqa: E402


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("M,D", [(1, 7168), (300, 7168), (5, 96), (0, 512)])
def test_rms_norm_matches_reference(M, D):
    g = torch.Generator(device="cuda").manual_seed(M + D)
    x = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    got, want = norm.rms_norm(x, w, eps=1e-6), norm_ref.rms_norm(x, w, eps=1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    if M:
        assert _rel(got, want) < 8e-3  # bf16 output rounding


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("M,inter", [(1, 3072), (128, 192), (7, 100), (0, 64)])
def test_glu_matches_reference(M, inter, act):
    g = torch.Generator(device="cuda").manual_seed(M + inter)
    h = (torch.randn(M, 2 * inter, device="cuda", generator=g) * 8).to(torch.bfloat16)
    got = mlp.glu(h, act=act, beta=4.0, linear_beta=25.0)
    want = mlp_ref.glu(h[:, :inter], h[:, inter:], act=act, beta=4.0, linear_beta=25.0)
    assert got.dtype == want.dtype and got.shape == want.shape
    if M:
        assert _rel(got, want) < 8e-3  # bf16 output rounding


@pytest.mark.parametrize("K", [0, 1, 8, 11])
@pytest.mark.parametrize("M,D", [(1, 7168), (128, 7168), (3, 96)])
@pytest.mark.parametrize("split", [0, ar.SPLIT_CHUNK])
def test_attn_res_matches_reference(K, M, D, split):
    """Snapshots as the executor passes them (K separate tensors, read in place; 11 are stacked) and stacked; one
    program a token, or the split form (D 96: one part-masked chunk)."""
    g = torch.Generator(device="cuda").manual_seed(K * 1000 + M)
    partial = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    blocks = [torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(K)]
    proj, nw = torch.randn(D, device="cuda", generator=g) * D ** -0.5, torch.ones(D, device="cuda")
    want = ar_ref.attn_res(partial, blocks, proj, nw, eps=1e-6)
    for form in (blocks, torch.stack(blocks) if K else torch.empty(0, M, D, device="cuda", dtype=torch.bfloat16)):
        got = ar.attn_res(partial, form, proj, nw, eps=1e-6, split=split)
        assert got.dtype == torch.bfloat16 and _rel(got, want) < 8e-3, (K, M, D, split)
    # the residual add fused: the same mix of partial + delta, and exactly the separate add's running sum
    delta = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    want_d, want_sum = ar_ref.attn_res(partial, blocks, proj, nw, eps=1e-6, delta=delta)
    got_d, got_sum = ar.attn_res(partial, blocks, proj, nw, eps=1e-6, split=split, delta=delta)
    assert torch.equal(got_sum, want_sum) and _rel(got_d, want_d) < 8e-3, (K, M, D, split)


def _bf16_ulps(a, b):
    """The largest |a - b| in bf16 ulps of the larger of |a|, |b| (8 significant bits)."""
    a, b = a.float(), b.float()
    big = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(torch.bfloat16).smallest_normal)
    return ((a - b).abs() / torch.exp2(torch.floor(torch.log2(big)) - 7)).max().item()


@pytest.mark.parametrize("fused_add", [False, True], ids=["plain", "delta"])
@pytest.mark.parametrize("K", [0, 1, 8, 11])
@pytest.mark.parametrize("M,D", [(1, 7168), (128, 7168), (3, 96)])
@pytest.mark.parametrize("split", [0, ar.SPLIT_CHUNK])
def test_attn_res_out_norm_matches_reference_and_unfused(K, M, D, split, fused_add):
    """The next RMSNorm fused (out_norm) vs the reference, and vs the unfused launches (the mix stored, then the
    RMSNorm kernel) within 3 bf16 ulps of each value, or 2^-12 of the row's RMS near zero. The split form's fused
    mix (one program a token) sums the chunks' partial scores in another order than the chunked mix, so a mix value
    may round the other way (one ulp: up to 2^-7 relative), which the normalisation carries to the output, rounded
    again (H200, nineteenth session: 103 of 917504 values differ at 128 tokens and 8 snapshots, by 1-2 ulps; the
    single form and one token: none). That comparison takes power-of-two weights, exact to apply. The running sum
    is exact."""
    g = torch.Generator(device="cuda").manual_seed(K * 1000 + M + 7)
    partial = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    blocks = [torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(K)]
    proj, nw = torch.randn(D, device="cuda", generator=g) * D ** -0.5, torch.ones(D, device="cuda")
    delta = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16) if fused_add else None
    weight = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    pow2 = torch.exp2(torch.randint(-1, 2, (D,), device="cuda", generator=g).float()).to(torch.bfloat16)
    kw = dict(eps=1e-6, delta=delta)
    want = ar_ref.attn_res(partial, blocks, proj, nw, out_norm=weight, out_eps=1e-5, **kw)
    got = ar.attn_res(partial, blocks, proj, nw, out_norm=weight, out_eps=1e-5, split=split, **kw)
    got_pow2 = ar.attn_res(partial, blocks, proj, nw, out_norm=pow2, out_eps=1e-5, split=split, **kw)
    mixed = ar.attn_res(partial, blocks, proj, nw, split=split, **kw)
    if fused_add:
        (want, want_sum), (got, got_sum), (got_pow2, _), (mixed, _) = want, got, got_pow2, mixed
        assert torch.equal(got_sum, want_sum)
    unfused = norm.rms_norm(mixed, pow2, eps=1e-5)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == (M, D)
    if M:
        assert _rel(got, want) < 8e-3, (K, M, D, split)  # bf16 output rounding
        a, b = got_pow2.float(), unfused.float()
        ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(1e-30))) - 7)
        rms = b.pow(2).mean(-1, keepdim=True).sqrt()
        assert ((a - b).abs() <= torch.maximum(3 * ulp, rms / 4096)).all(), (K, M, D, split, _bf16_ulps(a, b))


@pytest.mark.parametrize("M,k,E,start", [(1, 16, 56, 0), (128, 16, 56, 560), (448, 16, 56, 112), (2048, 16, 56, 112),
                                         (7, 4, 3, 5)])
@pytest.mark.parametrize("cols", [None, 1], ids=["host_cols", "flat"])  # the host's tiles, and one flat scan
def test_sort_pairs_matches_a_stable_sort(M, k, E, start, cols):
    g = torch.Generator(device="cuda").manual_seed(M)
    ids = torch.stack([torch.randperm(896, device="cuda", generator=g)[:k] for _ in range(M)]) % (E * 16)
    order, offsets, inv = sort_pairs(ids, start, E, cols=cols)
    key = ids.reshape(-1) - start
    key = torch.where((key >= 0) & (key < E), key, E)
    want = torch.sort(key, stable=True).indices
    local = int((key < E).sum())
    assert torch.equal(order[:local].long(), want[:local])
    assert torch.equal(offsets.long(), torch.searchsorted(key.sort().values, torch.arange(E + 1, device="cuda")))
    pos = torch.full_like(key, -1)
    pos[want[:local]] = torch.arange(local, device="cuda")
    assert torch.equal(inv.long(), pos)
