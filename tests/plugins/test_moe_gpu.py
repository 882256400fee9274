"""Triton MXFP4 MoE vs the torch reference on the GPU (pytest -m gpu)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3plugins.moe import triton as mt  # noqa: E402
from k3plugins.moe.reference import moe_experts as moe_ref  # noqa: E402


def _case(M, k, E, e_global, start, dl, inter, seed, empty=()):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    z = torch.randn(M, dl, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e_global, device=dev, generator=g)[:k] for _ in range(M)])
    for e in empty:  # move picks of these local experts elsewhere (off-rank)
        ids = torch.where(ids == start + e, (start + E) % e_global, ids)
    w = torch.rand(M, k, device=dev, generator=g)
    w13 = torch.randint(0, 256, (E, 2 * inter, dl // 2), dtype=torch.uint8, device=dev, generator=g)
    s13 = torch.randint(118, 126, (E, 2 * inter, dl // 32), dtype=torch.uint8, device=dev, generator=g)
    w2 = torch.randint(0, 256, (E, dl, inter // 2), dtype=torch.uint8, device=dev, generator=g)
    s2 = torch.randint(118, 126, (E, dl, inter // 32), dtype=torch.uint8, device=dev, generator=g)
    return z, ids, w, w13, s13, w2, s2


CASES = {
    "one_token": (1, 16, 8, 64, 8, 512, 256),
    "ragged": (37, 8, 12, 40, 4, 512, 512),
    "all_local": (50, 4, 6, 6, 0, 256, 512),
    "none_local": (9, 4, 6, 30, 24, 256, 256),
    "k3_dims": (64, 16, 56, 896, 112, 3584, 3072),
}


@pytest.mark.parametrize("tactic", sorted(mt.TACTICS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_matches_reference(case, tactic, act="situ"):
    M, k, E, eg, start, dl, inter = CASES[case]
    z, ids, w, w13, s13, w2, s2 = _case(M, k, E, eg, start, dl, inter, seed=hash(case) % 1000,
                                        empty=(1,) if case == "ragged" else ())
    ok, why = mt.supports(z, w13, w2, tactic=tactic)
    if not ok:
        pytest.skip(why)
    # the "*_s" / "*_p" / "*_l" tactics read the strided / paired / lane layouts (and "*_l" z in its K order): the
    # reference keeps the originals
    a, b = mt.lay_out(tactic, w13), mt.lay_out(tactic, w2)
    sa, sb = mt.lay_out_scale(tactic, s13), mt.lay_out_scale(tactic, s2)
    zt = mt.lay_out_input(tactic, z)
    out = mt.moe_experts(zt, ids, w, a, sa, b, sb, expert_start=start, act=act, tactic=tactic)
    if mt.TACTICS[tactic].fp8:  # the kernel sees e4m3 activations (the scales here keep the weights exact in e4m3)
        q, scale = mt.quantize_e4m3(z)
        z = (q.float() * scale[:, None]).to(z.dtype)
    ref = moe_ref(z, ids, w, w13, s13, w2, s2, expert_start=start, act=act)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    if ref.abs().max() == 0:
        assert out.abs().max() == 0
        return
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("name", ["decode_l", "prefill_l"])
@pytest.mark.parametrize("case", ["ragged", "k3_dims"])
def test_lane_plain_product_matches_reference(case, name):
    """The lane tactics with the plain bf16 product instead of the packed PTX multiply (packed_mul off: the branch
    ROCm runs) against the reference."""
    from dataclasses import replace
    M, k, E, eg, start, dl, inter = CASES[case]
    z, ids, w, w13, s13, w2, s2 = _case(M, k, E, eg, start, dl, inter, seed=5, empty=(1,))
    t = replace(mt.TACTICS[name], packed_mul=False)
    out = mt.moe_experts(mt.lay_out_input(t, z), ids, w, mt.lay_out(t, w13), mt.lay_out_scale(t, s13), mt.lay_out(t, w2),
                         mt.lay_out_scale(t, s2), expert_start=start, act="situ", tactic=t)
    ref = moe_ref(z, ids, w, w13, s13, w2, s2, expert_start=start, act="situ")
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


def _decode_l_case(case: str, seed: int, empty: tuple):
    """A case laid out for decode_l, whose variants (decode_l_yh, _gc, _sr) read the same layouts: (moe_experts'
    tensor arguments, expert_start, the case as _case made it)."""
    M, k, E, eg, start, dl, inter = CASES[case]
    raw = _case(M, k, E, eg, start, dl, inter, seed=seed, empty=empty)
    z, ids, w, w13, s13, w2, s2 = raw
    t = mt.TACTICS["decode_l"]
    return (mt.lay_out_input(t, z), ids, w, mt.lay_out(t, w13), mt.lay_out_scale(t, s13), mt.lay_out(t, w2),
            mt.lay_out_scale(t, s2)), start, raw


@pytest.mark.parametrize("case", ["ragged", "k3_dims"])
def test_half_pair_rows_match_reference(case):
    """decode_l_yh (decode_l with the per-pair rows y in bf16) against the reference, and against decode_l's fp32
    rows: close, and not the same bits."""
    args, start, raw = _decode_l_case(case, seed=6, empty=(1,))
    half = mt.moe_experts(*args, expert_start=start, act="situ", tactic="decode_l_yh")
    full = mt.moe_experts(*args, expert_start=start, act="situ", tactic="decode_l")
    ref = moe_ref(*raw, expert_start=start, act="situ")
    assert half.dtype == torch.float32
    assert ((half - ref).norm() / ref.norm()).item() < 1e-2
    assert 0 < ((half - full).norm() / full.norm()).item() < 5e-3


@pytest.mark.parametrize("case", ["ragged", "all_local", "k3_dims"])
def test_gathering_combine_matches_the_loop(case):
    """decode_l_gc against decode_l: the same per-pair rows, each token's summed in another order (fp32), so within
    a few ulps; a row dropped or added would be far off."""
    args, start, _ = _decode_l_case(case, seed=7, empty=(1,) if case == "ragged" else ())
    loop = mt.moe_experts(*args, expert_start=start, act="situ", tactic="decode_l")
    gather = mt.moe_experts(*args, expert_start=start, act="situ", tactic="decode_l_gc")
    assert ((gather - loop).norm() / loop.norm()).item() < 1e-5


def test_moe_silu():
    test_moe_matches_reference("ragged", "decode", act="silu")


def test_moe_large_m_prefill():
    z, ids, w, w13, s13, w2, s2 = _case(600, 8, 8, 16, 0, 512, 512, seed=3)
    ref = moe_ref(z, ids, w, w13, s13, w2, s2, expert_start=0, act="situ")
    for tactic in ("prefill", "decode"):
        out = mt.moe_experts(z, ids, w, w13, s13, w2, s2, expert_start=0, act="situ", tactic=tactic)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2


def test_dequantize_matches_codec():
    from k3plugins.moe.mxfp4 import dequantize_mxfp4
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randint(0, 256, (3, 64, 256), dtype=torch.uint8, device="cuda", generator=g)
    s = torch.randint(100, mt.W4_MAX_SCALE_BYTE + 1, (3, 64, 16), dtype=torch.uint8, device="cuda", generator=g)
    s[0, 0] = mt.W4_MAX_SCALE_BYTE  # the top of the exact range, with all 16 codes below
    w[0, 0, :8] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    ref = dequantize_mxfp4(w, s)
    assert torch.equal(mt.dequantize(w, s, torch.float32), ref)
    assert torch.equal(mt.dequantize(w, s, torch.bfloat16), ref.to(torch.bfloat16))


def test_deterministic():
    args = _case(40, 8, 8, 16, 0, 512, 512, seed=9)
    a = mt.moe_experts(*args, expert_start=0, act="situ")
    b = mt.moe_experts(*args, expert_start=0, act="situ")
    assert torch.equal(a, b)


def _captured(call):
    """call() run once (its kernels compiled), then captured: (the CUDA graph, its output tensor)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


@pytest.mark.parametrize("over_name", ["decode_p", "decode_l"])
@pytest.mark.parametrize("case", ["one_token", "ragged", "k3_dims"])
def test_overlapped_down_equals_plain(case, over_name):
    """MoETactic.overlap (the down kernel launched with PDL, each program awaiting its expert's gate/up programs) gives
    the plain launches' bits, replay after replay of one CUDA graph with new activations each time: a program that
    read its expert's h before it was whole, or an L1 line of the last replay's, would differ."""
    from dataclasses import replace
    M, k, E, eg, start, dl, inter = CASES[case]
    z, ids, w, w13, s13, w2, s2 = _case(M, k, E, eg, start, dl, inter, seed=11, empty=(1,))
    over = mt.TACTICS[over_name]
    plain = replace(over, rows_first=False, overlap=False)
    a, b = mt.lay_out(plain, w13), mt.lay_out(plain, w2)
    sa, sb = mt.lay_out_scale(plain, s13), mt.lay_out_scale(plain, s2)
    z = mt.lay_out_input(over, z)
    run = lambda t: mt.moe_experts(z, ids, w, a, sa, b, sb, expert_start=start, act="situ", tactic=t)
    graph, out = _captured(lambda: run(over))
    g = torch.Generator(device="cuda").manual_seed(12)
    for _ in range(20):
        z.copy_(torch.randn(z.shape, device="cuda", generator=g).to(z.dtype))
        graph.replay()
        assert torch.equal(out, run(plain))


@pytest.mark.parametrize("per_sm", [0, 1], ids=["all_programs", "first_wave"])
@pytest.mark.parametrize("case", ["one_token", "ragged", "k3_dims"])
def test_prefetch_equals_plain(case, per_sm):
    """MoETactic.prefetch (the gate/up kernel launched with PDL while the pair sort runs, asking L2 for its weights
    before it waits) gives decode_l's bits, replay after replay of one CUDA graph with new routing each time: a
    program that read the sort's offsets or order before the sort ended would take the last replay's pairs."""
    from dataclasses import replace
    args, start, _ = _decode_l_case(case, seed=13, empty=(1,))
    z, ids, w = (t.clone() for t in args[:3])
    E_global = CASES[case][3]
    run = lambda t: mt.moe_experts(z, ids, w, *args[3:], expert_start=start, act="situ", tactic=t)
    graph, out = _captured(lambda: run(replace(mt.TACTICS["decode_l"], prefetch=2, prefetch_per_sm=per_sm)))
    g = torch.Generator(device="cuda").manual_seed(14)
    for _ in range(20):
        ids.copy_(torch.stack([torch.randperm(E_global, device="cuda", generator=g)[:ids.shape[1]]
                               for _ in range(ids.shape[0])]))
        z.copy_(torch.randn(z.shape, device="cuda", generator=g).to(z.dtype))
        graph.replay()
        assert torch.equal(out, run("decode_l"))
