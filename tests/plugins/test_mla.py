import pytest
import torch
import torch.nn.functional as F

from k3plugins.mla import mla_mixer

DIMS = dict(num_heads=3, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
R, HIDDEN = 32, 40


def _weights(seed, q_lora, gate, H=3, nope=16, rope=8, vd=12):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    q_in = 24 if q_lora else HIDDEN
    return dict(q_a=r(q_in, HIDDEN) if q_lora else None, q_a_norm=torch.rand(q_in, generator=g) + 0.5 if q_lora else None,
                q_b=r(H * (nope + rope), q_in) * 3, kv_a=r(R + rope, HIDDEN) * 3,
                kv_a_norm=torch.rand(R, generator=g) + 0.5, kv_b=r(H * (nope + vd), R),
                g=r(H * vd, HIDDEN) if gate else None, o=r(HIDDEN, H * vd))


def _absorb(kv_b, H=3, nope=16, vd=12):
    """The builder's split of kv_b_proj [H*(nope+v), r], head-major [k_nope | v] rows per head."""
    per_head = kv_b.view(H, nope + vd, -1)
    return per_head[:, :nope].contiguous(), per_head[:, nope:].transpose(1, 2).contiguous()


def _rms(v, w, eps):
    return w * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def _naive(x, w, H=3, nope=16, rope=8, vd=12, eps=1e-6):
    """One whole sequence, non-absorbed: per-head K/V expanded from kv_b_proj, causal softmax."""
    T = x.shape[0]
    q_src = x if w["q_a"] is None else _rms(x @ w["q_a"].T, w["q_a_norm"], eps)
    q = (q_src @ w["q_b"].T).view(T, H, nope + rope)
    ckv = x @ w["kv_a"].T
    kv = (_rms(ckv[:, :R], w["kv_a_norm"], eps) @ w["kv_b"].T).view(T, H, nope + vd)
    k = torch.cat([kv[..., :nope], ckv[:, None, R:].expand(T, H, rope)], dim=-1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), kv[..., nope:].transpose(0, 1),
                                       is_causal=True, scale=(nope + rope) ** -0.5).transpose(0, 1)
    o = o.reshape(T, H * vd)
    if w["g"] is not None:
        o = o * torch.sigmoid(x @ w["g"].T)
    return o @ w["o"].T


def _cache(num_pages, page_size, dtype=torch.float32):
    # NaN everywhere: reading a position that was never written poisons the output.
    return torch.full((num_pages, page_size, R + DIMS["qk_rope_head_dim"]), float("nan"), dtype=dtype)


def _in_proj(w):
    """The builder's stacking: q_a (or the plain q_proj, which then sits in q_b's place), kv_a, then the gate."""
    q = w["q_a"] if w["q_a"] is not None else w["q_b"]
    return torch.cat([q, w["kv_a"]] + ([w["g"]] if w["g"] is not None else []))


def _run(x, w, cache, cu, ctx, table, **kw):
    w_uk, w_uv = _absorb(w["kv_b"])
    lora = w["q_a"] is not None
    return mla_mixer(x, _in_proj(w), w["q_a_norm"], w["q_b"] if lora else None, w["kv_a_norm"], w_uk, w_uv, w["o"],
                     cache, cu_seqlens=torch.tensor(cu), context_lens=torch.tensor(ctx),
                     page_table=torch.tensor(table, dtype=torch.int32), **DIMS,
                     scale=(DIMS["qk_nope_head_dim"] + DIMS["qk_rope_head_dim"]) ** -0.5, latent_eps=1e-6,
                     output_gate=int(w["g"] is not None), **kw)


def _table(pages, width):
    return pages + [-1] * (width - len(pages))


@pytest.mark.parametrize("q_lora,gate", [(True, True), (False, True), (True, False)],
                         ids=["qlora-gate", "noqlora-gate", "qlora-nogate"])
@pytest.mark.parametrize("T,page_size", [(63, 64), (100, 4)], ids=["T63-ps64", "T100-ps4"])
def test_absorbed_matches_naive(q_lora, gate, T, page_size):
    w = _weights(T, q_lora, gate)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(T + 1))
    need = -(-T // page_size)
    # Non-contiguous, shuffled page ids; the remaining pages stay NaN.
    pages = torch.randperm(2 * need + 1, generator=torch.Generator().manual_seed(2))[:need].tolist()
    cache = _cache(2 * need + 1, page_size)
    out = _run(x, w, cache, [0, T], [T], [_table(pages, need + 2)])
    torch.testing.assert_close(out, _naive(x, w), rtol=1e-5, atol=1e-5)
    unused = sorted(set(range(2 * need + 1)) - set(pages))
    assert cache[unused].isnan().all()
    written = cache[pages].reshape(-1, cache.shape[-1])[:T]
    # the last page, which the step began, is cleared past the sequence's last row (an earlier owner's NaN there
    # would poison the device kernels, which multiply a zero probability by every row of it)
    assert not written.isnan().any() and (cache[pages].reshape(-1, cache.shape[-1])[T:] == 0).all()


@pytest.mark.parametrize("piece", [1, 7, 100], ids=["piece1", "piece7", "whole"])
@pytest.mark.parametrize("page_size", [4, 64], ids=["ps4", "ps64"])
def test_chunked_prefill_invariance(piece, page_size):
    T = 100
    w = _weights(5, True, True)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(6))
    need = -(-T // page_size)
    table = [_table([3 * i + 1 for i in range(need)], need)]
    cache = _cache(3 * need + 1, page_size)
    outs = []
    for s in range(0, T, piece):
        e = min(s + piece, T)
        outs.append(_run(x[s:e], w, cache, [0, e - s], [e], table))
    torch.testing.assert_close(torch.cat(outs), _naive(x, w), rtol=1e-5, atol=1e-5)
    whole_cache = _cache(3 * need + 1, page_size)
    _run(x, w, whole_cache, [0, T], [T], table)
    torch.testing.assert_close(cache, whole_cache, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_ragged_batch_mixed_prefill_and_decode():
    page_size = 4
    w = _weights(9, True, True)
    gen = torch.Generator().manual_seed(10)
    prior, new = [0, 9, 5, 30], [13, 1, 7, 1]          # prefill from scratch, decode, chunked prefill, decode
    full = [torch.randn(p + n, HIDDEN, generator=gen) for p, n in zip(prior, new)]
    width = max(-(-(p + n) // page_size) for p, n in zip(prior, new))
    free = torch.randperm(64, generator=gen).tolist()
    tables = [_table([free.pop() for _ in range(-(-(p + n) // page_size))], width) for p, n in zip(prior, new)]
    cache = _cache(64, page_size)
    for n, p in enumerate(prior):
        if p:
            _run(full[n][:p], w, cache, [0, p], [p], [tables[n]])
    alone_cache = cache.clone()
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    x = torch.cat([f[p:] for f, p in zip(full, prior)])
    ctx = [p + n for p, n in zip(prior, new)]
    batched = _run(x, w, cache, cu, ctx, tables)
    alone = [_run(full[n][prior[n]:], w, alone_cache, [0, new[n]], [ctx[n]], [tables[n]]) for n in range(4)]
    torch.testing.assert_close(batched, torch.cat(alone), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache, alone_cache, rtol=1e-6, atol=1e-6, equal_nan=True)
    naive_new = torch.cat([_naive(f, w)[p:] for f, p in zip(full, prior)])
    torch.testing.assert_close(batched, naive_new, rtol=1e-5, atol=1e-5)


def test_bf16_smoke_with_bf16_cache():
    T = 63
    w = _weights(11, True, True)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(12))
    wb = {n: None if t is None else t.bfloat16() for n, t in w.items()}
    cache = _cache(2, 64, dtype=torch.bfloat16)
    out = _run(x.bfloat16(), wb, cache, [0, T], [T], [[1, -1]])
    ref = _naive(x.bfloat16().float(), {n: None if t is None else t.float() for n, t in wb.items()})
    assert out.dtype == torch.bfloat16 and cache[0].isnan().all()
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0) > 0.999
    assert (out.float() - ref).norm() / ref.norm() < 3e-2


def test_rejects_bad_input():
    w = _weights(0, True, True)
    x = torch.randn(6, HIDDEN)
    with pytest.raises(ValueError, match="no page assigned"):
        _run(x, w, _cache(4, 4), [0, 6], [6], [[2, -1]])
    with pytest.raises(ValueError, match="beyond its 1 page-table entries"):
        _run(x, w, _cache(4, 4), [0, 6], [6], [[2]])
    with pytest.raises(ValueError, match="context_lens"):
        _run(x, w, _cache(4, 4), [0, 6], [5], [[2, 3]])
    kw = dict(cu_seqlens=torch.tensor([0, 6]), context_lens=torch.tensor([6]), page_table=torch.tensor([[0, 1]]),
              **DIMS, scale=0.2, latent_eps=1e-6)
    w_uk, w_uv = _absorb(w["kv_b"])
    with pytest.raises(ValueError, match="w_uk must be"):
        mla_mixer(x, _in_proj(w), w["q_a_norm"], w["q_b"], w["kv_a_norm"], torch.ones(3, 16, 31), w_uv, w["o"],
                  _cache(4, 4), output_gate=1, **kw)
    # in_proj without the gate's rows, for an engine that says it has a gate
    with pytest.raises(ValueError, match=r"in_proj_weight must be \[100, 40\], got \[64, 40\]"):
        mla_mixer(x, _in_proj(w)[:64], w["q_a_norm"], w["q_b"], w["kv_a_norm"], w_uk, w_uv, w["o"], _cache(4, 4),
                  output_gate=1, **kw)
    with pytest.raises(ValueError, match="both be given"):
        mla_mixer(x, _in_proj(w), w["q_a_norm"], None, w["kv_a_norm"], w_uk, w_uv, w["o"], _cache(4, 4),
                  output_gate=1, **kw)


def test_host_seqs_are_checked_against_the_step():
    """The host's (new tokens, context) of each sequence, which the device tactics trust to pick the prefill form,
    must be the step's: equal ones change nothing, others are refused naming both."""
    w = _weights(0, True, True)
    x = torch.randn(7, HIDDEN)
    args = ([0, 6, 7], [6, 1], [[0, 1], [2, -1]])
    want = _run(x, w, _cache(4, 4), *args)
    assert torch.equal(_run(x, w, _cache(4, 4), *args, host_seqs=((6, 6), (1, 1))), want)
    for bad in (((6, 6), (1, 2)), ((6, 6),), ((7, 6), (0, 1))):
        with pytest.raises(ValueError, match=r"host_seqs .* differ from the step's \(new tokens, context\)"):
            _run(x, w, _cache(4, 4), *args, host_seqs=bad)


def test_unabsorbed_sequences_picked_by_host_lengths(monkeypatch):
    """prefill.sequences: the sequences with MIN_NEW_TOKENS new tokens or more, with their rows and context; none
    without the host's lengths; lengths that do not fit the step refused; other_rows: the rest, in order (None if
    none)."""
    pytest.importorskip("triton")
    from k3plugins.mla import prefill
    monkeypatch.setattr(prefill, "MIN_NEW_TOKENS", 3)
    cu = torch.tensor([0, 1, 5, 7, 10])
    picked = prefill.sequences(((1, 9), (4, 4), (2, 30), (3, 8)), cu, 10, 96)
    assert picked == [(1, 1, 5, 4), (3, 7, 10, 8)]
    assert prefill.other_rows(picked, 10, torch.device("cpu")).tolist() == [0, 5, 6]
    assert prefill.other_rows([(0, 0, 4, 4)], 4, torch.device("cpu")) is None  # every row picked
    assert prefill.other_rows([(0, 0, 4, 4)], 6, torch.device("cpu")).tolist() == [4, 5]
    assert prefill.sequences(None, cu, 10, 96) == []
    with pytest.raises(ValueError, match="host_seqs gives 3 sequences of 7 new tokens; the step has 4 of 10"):
        prefill.sequences(((1, 9), (4, 4), (2, 30)), cu, 10, 96)
    with pytest.raises(ValueError, match=r"host_seqs\[1\] has 4 new tokens in a context of 3"):
        prefill.sequences(((1, 9), (4, 3), (2, 30), (3, 8)), cu, 10, 96)


def test_launch_groups_share_a_piece():
    """attend_sequences' launches: consecutive sequences while their contexts' whole pages fit one piece, a
    context over a piece alone (mha_prefill takes it in pieces); order kept."""
    pytest.importorskip("triton")
    from k3plugins.mla import prefill
    seqs = [(0, 0, 200, 200), (1, 200, 400, 300), (3, 401, 900, 1000), (4, 900, 1000, 130), (5, 1000, 1100, 100)]
    # pages of 64: 4, 5, 16, 3 and 2 pages' keys (256, 320, 1024, 192, 128)
    assert [[s[0] for s in g] for g in prefill.launch_groups(seqs, 64, 1024)] == [[0, 1], [3], [4, 5]]
    assert [[s[0] for s in g] for g in prefill.launch_groups(seqs, 64, 640)] == [[0, 1], [3], [4, 5]]
    assert [[s[0] for s in g] for g in prefill.launch_groups(seqs, 64, 575)] == [[0], [1], [3], [4, 5]]
    assert [[s[0] for s in g] for g in prefill.launch_groups(seqs, 64, 1 << 20)] == [[0, 1, 3, 4, 5]]
    assert [[s[0] for s in g] for g in prefill.launch_groups(seqs, 64, 1)] == [[0], [1], [3], [4], [5]]
    assert prefill.launch_groups([], 64, 1024) == []


@pytest.mark.parametrize("heads, seqs, taken", [
    (96, ((128, 128), (128, 200), (128, 1024), (128, 128)), True),  # four, 512 new tokens, contexts <= 8x
    (96, ((128, 128), (128, 200), (128, 1025), (128, 128)), False),  # one context over 8x its new tokens: three
    (16, ((128, 128), (128, 200), (128, 1500), (128, 128)), True),  # at up to 16 heads any context
    (96, ((128, 128), (128, 128), (127, 127), (128, 128)), False),  # 511 new tokens between them
    (96, ((171, 171), (171, 171), (171, 171)), False),  # three
    (96, ((64, 64), (64, 64), (1, 500), (64, 64), (64, 64), (64, 64), (64, 64), (64, 64), (64, 64)), True),
    (96, ((63, 63), (150, 150), (150, 150), (150, 150), (150, 150)), True),  # 63 new tokens stay absorbed
])
@pytest.mark.parametrize("shared", [True, False])
def test_sequences_take_the_mha_form_together(heads, seqs, taken, shared, monkeypatch):
    """sequences with SHARED_LAUNCH: TOGETHER_LEAST's four sequences or more, of 64 new tokens or more (above 16
    heads with a context of at most 8x them) and 512 between them, all take the MHA form (under every other
    threshold); without SHARED_LAUNCH (each alone would launch alone) none."""
    pytest.importorskip("triton")
    from k3plugins.mla import prefill
    monkeypatch.setattr(prefill, "SHARED_LAUNCH", shared)
    cu = torch.tensor([0, *(new for new, _ in seqs)]).cumsum(0)
    picked = prefill.sequences(seqs, cu, int(cu[-1]), heads)
    starts = cu.tolist()
    joined = [(n, starts[n], starts[n + 1], ctx) for n, (new, ctx) in enumerate(seqs)
              if new >= prefill.TOGETHER_MIN_NEW_TOKENS
              and (heads <= prefill.TOGETHER_ANY_CONTEXT_HEADS or ctx <= prefill.TOGETHER_CONTEXT_PER_NEW * new)]
    assert picked == (joined if taken and shared else [])


@pytest.mark.parametrize("heads, least", [(1, 128), (6, 128), (16, 128), (17, 192), (48, 192), (64, 192),
                                          (65, 256), (96, 256), (128, 256)])
def test_fewer_heads_take_the_mha_form_from_fewer_new_tokens(heads, least, monkeypatch):
    """min_new_tokens: the threshold a head count (FEW_HEADS_MIN_NEW_TOKENS' first row that holds it, else
    MIN_NEW_TOKENS) for contexts of FEW_HEADS_MIN_CONTEXT tokens or more, MIN_NEW_TOKENS for shorter ones; never
    above MIN_NEW_TOKENS (the tests that lower it lower every threshold); sequences picks by it."""
    pytest.importorskip("triton")
    from k3plugins.mla import prefill
    long, short = prefill.FEW_HEADS_MIN_CONTEXT, prefill.FEW_HEADS_MIN_CONTEXT - 1
    assert prefill.min_new_tokens(heads, long) == least
    assert prefill.min_new_tokens(heads, short) == prefill.MIN_NEW_TOKENS
    cu = torch.tensor([0, least - 1, 2 * least - 1, 3 * least - 1])
    picked = prefill.sequences(((least - 1, long), (least, long), (least, short)), cu, 3 * least - 1, heads)
    want = [(1, least - 1, 2 * least - 1, long)]
    if least == prefill.MIN_NEW_TOKENS:  # the short context's threshold too
        want.append((2, 2 * least - 1, 3 * least - 1, short))
    assert picked == want
    monkeypatch.setattr(prefill, "MIN_NEW_TOKENS", 3)
    assert prefill.min_new_tokens(heads, long) == prefill.min_new_tokens(heads, short) == 3


@pytest.mark.parametrize("heads,rows,sms,block", [(6, 256, 132, (64, 4)), (16, 512, 132, (64, 4)),
                                                   (6, 2048, 132, (128, 8)), (96, 256, 132, (128, 8)),
                                                   (16, 512, 127, (128, 8)), (6, 256, 0, (128, 8))])
def test_mha_prefill_query_block(heads, rows, sms, block):
    """64-row query blocks in 4 warps only where 128-row ones would leave half the SMs or more idle (unknown SMs,
    the interpreter: 128)."""
    pytest.importorskip("triton")
    from k3plugins.mla.prefill import query_block
    assert query_block(heads, rows, sms) == block
