"""Triton MLA paged decode attention vs its definition on the GPU (pytest -m gpu)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3plugins.mla.triton import mla_decode_attention  # noqa: E402


def _ref(ql, qp, kv, pt, lens, scale):
    out = []
    dl = ql.shape[-1]
    for b in range(ql.shape[0]):
        toks = kv[pt[b].long()].reshape(-1, kv.shape[-1])[: int(lens[b])].double()
        s = (ql[b].double() @ toks[:, :dl].T + qp[b].double() @ toks[:, dl:].T) * scale
        out.append(torch.softmax(s, -1) @ toks[:, :dl])
    return torch.stack(out)


def _paged_case(H: int, lens: list, dtype: torch.dtype, seed: int, dl: int = 512):
    """Queries (latent dl, rope 64), a shuffled paged cache with spare pages, its page table and lengths."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B = len(lens)
    max_pages = (max(lens) + 63) // 64
    num_pages = B * max_pages + 3
    kv = torch.randn(num_pages, 64, dl + 64, device="cuda", generator=g).to(dtype)
    pt = torch.randperm(num_pages, device="cuda", generator=g)[: B * max_pages].view(B, max_pages).int()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ql = torch.randn(B, H, dl, device="cuda", generator=g).to(dtype)
    qp = torch.randn(B, H, 64, device="cuda", generator=g).to(dtype)
    return ql, qp, kv, pt, lens_t


@pytest.mark.parametrize("H", [1, 16, 96])
@pytest.mark.parametrize("lens", [[1], [64], [65, 1, 300], [4096, 17, 2000, 128]], ids=str)
@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.parametrize("block_h,num_warps,exchange", [(16, None, False), (64, None, False), (64, 8, True),
                                                          (64, 16, True)])
def test_mla_decode_matches_definition(H, lens, splits, block_h, num_warps, exchange):
    if block_h == 64 and H != 96:
        pytest.skip("block_h=64 is the 96-head config")
    ql, qp, kv, pt, lens_t = _paged_case(H, lens, torch.bfloat16, seed=len(lens) * 100 + H)
    B = len(lens)
    out = mla_decode_attention(ql, qp, kv, pt, lens_t, scale=192 ** -0.5, num_splits=splits, block_h=block_h,
                               num_warps=num_warps, exchange=exchange)
    ref = _ref(ql, qp, kv, pt, lens_t, 192 ** -0.5)
    assert out.shape == (B, H, 512) and torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel is sm_90 only")
@pytest.mark.parametrize("H", [64, 96, 128])
@pytest.mark.parametrize("lens", [[1], [64], [65, 1, 300], [4096, 17, 2000, 128], [8192] * 3], ids=str)
@pytest.mark.parametrize("splits", [None, 4, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_mla_decode_matches_definition(H, lens, splits, dtype):
    """The sm_90 Gluon kernel (TMA pages, two page buffers, warp-specialized): ragged contexts, one token, a last
    page of one token, more splits than pages (empty slices), a head count that is not a multiple of its 64-head
    block."""
    ql, qp, kv, pt, lens_t = _paged_case(H, lens, dtype, seed=len(lens) * 100 + H)
    B = len(lens)
    out = mla_decode_attention(ql, qp, kv, pt, lens_t, scale=192 ** -0.5, num_splits=splits, kernel="gluon")
    ref = _ref(ql, qp, kv, pt, lens_t, 192 ** -0.5)
    assert out.shape == (B, H, 512) and out.dtype == dtype and torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    same = mla_decode_attention(ql, qp, kv, pt, lens_t, scale=192 ** -0.5, num_splits=splits)
    assert ((out.double() - same.double()).norm() / ref.norm()).item() < 1e-2


def _knob_on_and_off(monkeypatch, knob: str, H: int, lens: list[int], dtype, splits, seed: int):
    """(output with gluon_sm90.<knob> on, output with it off, the fp64 definition) of the Gluon kernel on a paged
    case."""
    from k3plugins.mla import gluon_sm90
    ql, qp, kv, pt, lens_t = _paged_case(H, lens, dtype, seed=seed)
    run = lambda: mla_decode_attention(ql, qp, kv, pt, lens_t, scale=192 ** -0.5, num_splits=splits,  # noqa: E731
                                       kernel="gluon")
    monkeypatch.setattr(gluon_sm90, knob, False)
    before = run()
    monkeypatch.setattr(gluon_sm90, knob, True)
    return run(), before, _ref(ql, qp, kv, pt, lens_t, 192 ** -0.5)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel is sm_90 only")
@pytest.mark.parametrize("H", [64, 96])
@pytest.mark.parametrize("narrow", [False, True], ids=["wide", "narrow"])
@pytest.mark.parametrize("lens", [[1], [64], [65, 1, 300], [4096, 17, 2000, 128], [8192] * 3], ids=str)
@pytest.mark.parametrize("splits", [None, 4, 64])
def test_gluon_mla_lean_softmax_matches_definition(H, narrow, lens, splits, monkeypatch):
    """LEAN_SOFTMAX: the mask only on the context's last page (a full last page, a last page of one token, a split
    whose pages are all inside the context), the scale in the exponent; against the fp64 definition and the softmax
    before."""
    from k3plugins.mla import gluon_sm90
    monkeypatch.setattr(gluon_sm90, "NARROW_REMAINDER", narrow)
    out, before, ref = _knob_on_and_off(monkeypatch, "LEAN_SOFTMAX", H, lens, torch.bfloat16, splits,
                                        seed=len(lens) * 7 + H)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert ((out.double() - before.double()).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel is sm_90 only")
@pytest.mark.parametrize("H", [32, 96, 112])
@pytest.mark.parametrize("lens", [[1], [65, 1, 300], [4096, 17, 2000, 128]], ids=str)
@pytest.mark.parametrize("splits", [None, 4, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_mla_narrow_remainder_matches_definition(H, lens, splits, dtype, monkeypatch):
    """NARROW_REMAINDER: the last head block's 32 heads (or fewer: 112 = 64 + 48 keeps the 64-row block) on the
    MMA's N (the scores and values transposed), against the fp64 definition and the 64-row form."""
    out, wide, ref = _knob_on_and_off(monkeypatch, "NARROW_REMAINDER", H, lens, dtype, splits,
                                      seed=len(lens) * 10 + H)
    B = len(lens)
    assert out.shape == (B, H, 512) and out.dtype == dtype and torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert ((out.double() - wide.double()).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel is sm_90 only")
@pytest.mark.parametrize("H", [64, 96])
@pytest.mark.parametrize("narrow", [False, True], ids=["wide", "narrow"])
def test_gluon_mla_takes_a_256_wide_latent(H, narrow, monkeypatch):
    """The Gluon kernels on a 256 + 64 cache (gluon_sm90.LATENT_WIDTHS), ragged contexts and more splits than pages,
    against the fp64 definition."""
    from k3plugins.mla import gluon_sm90
    monkeypatch.setattr(gluon_sm90, "NARROW_REMAINDER", narrow)
    lens = [4096, 17, 2000, 1]
    ql, qp, kv, pt, lens_t = _paged_case(H, lens, torch.bfloat16, seed=H, dl=256)
    for splits in (None, 64):
        out = mla_decode_attention(ql, qp, kv, pt, lens_t, scale=192 ** -0.5, num_splits=splits, kernel="gluon")
        ref = _ref(ql, qp, kv, pt, lens_t, 192 ** -0.5)
        assert out.shape == (len(lens), H, 256) and torch.isfinite(out).all()
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_gluon_mla_refuses_what_it_does_not_run():
    kv = torch.zeros(4, 64, 576 - 256, device="cuda", dtype=torch.float32)
    q = torch.zeros(1, 64, 256, device="cuda")
    with pytest.raises(ValueError, match="bf16 or fp16|sm_90|dtype"):
        mla_decode_attention(q, q[..., :64], kv, torch.zeros(1, 4, dtype=torch.int32, device="cuda"),
                             torch.ones(1, dtype=torch.int32, device="cuda"), scale=1.0, kernel="gluon")


@pytest.mark.parametrize("T", [1, 7, 128, 16384])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["bf16_w", "fp32_w"])
def test_write_cache_equals_the_torch_launches(T, w_dtype):
    """The fused latent norm + concat + paged store writes the bits the three torch launches wrote (at 16K tokens
    some mean-squares round differently if the norm's sum adds in another order: 4 warps instead of
    rms_norm_kernel's 1 flipped about 50 values)."""
    from k3plugins.mla.triton import write_cache
    from k3plugins.norm.triton import rms_norm
    g = torch.Generator(device="cuda").manual_seed(T)
    ckv = torch.randn(T, 2 * 576, device="cuda", generator=g).to(torch.bfloat16)[:, :576]  # a column view, as split
    w = (1 + 0.1 * torch.randn(512, device="cuda", generator=g)).to(w_dtype)
    pages = torch.randperm(T + 3, device="cuda", generator=g)[:T]
    rows = torch.randint(0, 64, (T,), device="cuda", generator=g)
    fused = torch.randn(T + 3, 64, 576, device="cuda", generator=g).to(torch.bfloat16)
    plain = fused.clone()
    write_cache(ckv, w, fused, pages, rows, eps=1e-6)
    plain[pages, rows] = torch.cat([rms_norm(ckv[:, :512], w, eps=1e-6), ckv[:, 512:]], -1).to(plain.dtype)
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("gated", [True, False])
def test_gate_heads_matches_the_torch_launches(T, gated):
    from k3plugins.mla.triton import gate_heads
    g = torch.Generator(device="cuda").manual_seed(T)
    H, vd = 6, 128
    o = torch.randn(H, T, vd, device="cuda", generator=g).to(torch.bfloat16)
    gate = torch.randn(T, H * vd, device="cuda", generator=g).to(torch.bfloat16) if gated else None
    expect = o.transpose(0, 1).reshape(T, H * vd)
    expect = expect * torch.sigmoid(gate) if gated else expect
    out = gate_heads(o, gate)
    if not gated:
        assert torch.equal(out, expect)
    # the sigmoid's exp is Triton's, not torch's: a value may round the other way (one bf16 ulp)
    torch.testing.assert_close(out, expect, rtol=2 ** -7, atol=0)
    assert (out != expect).float().mean().item() < 0.01


def _mixer_step(H, tactic, new, ctx, pages, num_pages, host_seqs=False, poison=(), no_sync=False):
    """The tactic's mixer and the fp32 reference on one step at a rank's MLA shapes: (output, cache) of each.
    poison: (page, row) pairs from which the cache holds NaN before the step. no_sync: the tactic's mixer runs
    with torch.cuda.set_sync_debug_mode("error") (a device->host sync inside it raises)."""
    from k3plugins import registry
    from k3plugins.mla import reference
    if tactic == "gluon" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is sm_90 only")
    mixer = registry.find("MLA", tactic).load()
    g = torch.Generator(device="cuda").manual_seed(3)
    r_ = lambda *sh, sc=1.0: (torch.randn(*sh, device="cuda", generator=g) * sc).to(torch.bfloat16)  # noqa: E731
    nope, rope, r, vd, hid, ql = 128, 64, 512, 128, 512, 256
    in_proj = torch.cat([r_(ql, hid, sc=hid ** -0.5), r_(r + rope, hid, sc=hid ** -0.5),
                         r_(H * vd, hid, sc=hid ** -0.5)])
    args = (in_proj, 1 + 0.1 * r_(ql), r_(H * (nope + rope), ql, sc=ql ** -0.5), 1 + 0.1 * r_(r),
            r_(H, nope, r, sc=nope ** -0.5), r_(H, r, vd, sc=r ** -0.5), r_(hid, H * vd, sc=(H * vd) ** -0.5))
    cu = torch.tensor([0] + new, device="cuda").cumsum(0)
    pt = torch.tensor(pages, dtype=torch.int32, device="cuda")
    x = r_(int(cu[-1]), hid)
    cache = r_(num_pages, 64, r + rope)
    for page, row in poison:
        cache[page, row:] = float("nan")
    lens = torch.tensor(ctx, device="cuda")
    outs = []
    for fn in (mixer, reference.mla_mixer):
        c = cache.clone()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if no_sync and fn is mixer else "default")
        try:
            o = fn(x, *args, c, cu_seqlens=cu, context_lens=lens, page_table=pt, num_heads=H, qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope, v_head_dim=vd, scale=(nope + rope) ** -0.5, latent_eps=1e-6,
                   output_gate=1, host_seqs=tuple(zip(new, ctx)) if host_seqs else None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs.append((o.float(), c.float()))
    return outs


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("H,tactic", [(6, "triton"), (96, "gluon")])
@pytest.mark.parametrize("poison", [(), ((5, 1),)], ids=["", "nan_tail"])
def test_mixer_matches_reference_at_a_ranks_shapes(H, tactic, poison):
    """The Triton mixer (fused glue, strided queries) vs the fp32 reference on a rank's MLA slice: 6 heads (a TP
    slice), or all 96 with the "gluon" tactic's mixer (attention-DP), the 576-wide cache, a decode batch with one
    prefill row; both caches end equal but for bf16 rounding. nan_tail: the page the step begins (its first
    token's) held NaN past that row (an earlier owner's): cleared before the kernels read the whole page."""
    pages = [[0, 1, 2, 3, 4], [5, -1, -1, -1, -1], [6, 7, -1, -1, -1], [8, -1, -1, -1, -1]]
    (o1, c1), (o2, c2) = _mixer_step(H, tactic, [1, 1, 5, 1], [300, 1, 70, 64], pages, 10, poison=poison)
    assert _rel(o1, o2) < 2e-2
    assert _rel(c1, c2) < 1e-2


@pytest.mark.parametrize("H,tactic", [(6, "triton"), (96, "gluon")])
@pytest.mark.parametrize("pieces", [False, True], ids=["one_piece", "pieces"])
def test_mixer_unabsorbed_prefill_matches_reference(H, tactic, pieces, monkeypatch, mha_prefill_calls):
    """With the host's lengths, a 300-token chunk after 400 cached (over MIN_NEW_TOKENS) in the un-absorbed form
    beside decode tokens and a short prefill (absorbed), bf16, against the fp32 reference; pieces: the context in
    pieces of one page, merged in the kernel. The mixer makes no device->host sync (set_sync_debug_mode "error"):
    the absorbed rows' indices and every piece's bounds come from the host's lengths."""
    from k3plugins.mla import prefill
    if pieces:
        monkeypatch.setattr(prefill, "KEY_PIECE_BYTES", 1)
    pages = [[0, 1, 2, 3, 4, -1, -1, -1, -1, -1, -1], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
             [16, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1], [17, 18, -1, -1, -1, -1, -1, -1, -1, -1, -1]]
    (o1, c1), (o2, c2) = _mixer_step(H, tactic, [1, 300, 1, 40], [300, 700, 1, 70], pages, 20, host_seqs=True,
                                     no_sync=True)
    assert mha_prefill_calls == [300]
    assert _rel(o1, o2) < 2e-2
    assert _rel(c1, c2) < 1e-2


@pytest.mark.parametrize("H,tactic", [(6, "triton"), (96, "gluon")])
def test_mixer_unabsorbed_sequences_share_a_launch(H, tactic, monkeypatch, mha_prefill_calls):
    """With SHARED_LAUNCH, three prefill chunks in the un-absorbed form (300 after 400 cached, 200 after 30, 150
    fresh: their contexts fit one piece) go in one mha_prefill_varlen launch, beside absorbed decode tokens, bf16,
    against the fp32 reference, with no device->host sync (its block table comes from the host's lengths, copied
    from page-locked memory)."""
    from k3plugins.mla import prefill
    monkeypatch.setattr(prefill, "SHARED_LAUNCH", True)
    monkeypatch.setattr(prefill, "MIN_NEW_TOKENS", 128)  # 96 heads: 200 and 150 take the form too
    monkeypatch.setattr(prefill, "mha_prefill", lambda *a, **k: pytest.fail("a sequence launched alone"))
    none = [-1] * 11
    pages = [[0, 1, 2, 3, 4] + none[:6], list(range(5, 16)), [16] + none[:10], [17, 18, 19, 20] + none[:7],
             [21, 22, 23] + none[:8]]
    (o1, c1), (o2, c2) = _mixer_step(H, tactic, [1, 300, 1, 200, 150], [300, 700, 1, 230, 150], pages, 24,
                                     host_seqs=True, no_sync=True)
    assert mha_prefill_calls == [300, 200, 150]
    assert _rel(o1, o2) < 2e-2
    assert _rel(c1, c2) < 1e-2


@pytest.mark.parametrize("H,tactic", [(6, "triton"), (96, "gluon")])
@pytest.mark.parametrize("last", [128, 127], ids=["together", "too_few_tokens"])
def test_mixer_fresh_prompts_take_the_mha_form_together(H, tactic, last, monkeypatch, mha_prefill_calls):
    """Four fresh prompts of 64 to 192 tokens (512 between them: prefill.TOGETHER_LEAST) beside decode tokens take
    the un-absorbed form in one launch at the engine's own thresholds, bf16, against the fp32 reference, with no
    device->host sync; with one token fewer (511) all four stay absorbed."""
    from k3plugins.mla import prefill
    monkeypatch.setattr(prefill, "mha_prefill", lambda *a, **k: pytest.fail("a sequence launched alone"))
    none = [-1] * 5
    pages = [[0, 1, 2, 3, 4], [5, 6] + none[:3], [7, 8] + none[:3], [9] + none[:4], [10, 11, 12] + none[:2],
             [13, 14] + none[:3]]
    new = [1, 128, 64, 1, 192, last]
    (o1, c1), (o2, c2) = _mixer_step(H, tactic, new, [300, 128, 100, 1, 192, last], pages, 16, host_seqs=True,
                                     no_sync=True)
    assert mha_prefill_calls == ([128, 64, 192, 128] if last == 128 else [])
    assert _rel(o1, o2) < 2e-2
    assert _rel(c1, c2) < 1e-2
