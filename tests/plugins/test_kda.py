import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3plugins.kda import kda_gate, kda_mixer, kda_recurrent
from k3plugins.kda.reference import IN_PROJ_ROW_ALIGN, in_proj_rows


def _load_fla_naive():
    # fla's package __init__ may need triton and a GPU, so load the pure-torch module by path.
    spec = importlib.util.find_spec("fla")
    if spec is None:
        return None
    fla_dir = Path(spec.origin).parent
    spec = importlib.util.spec_from_file_location("fla_kda_naive", fla_dir / "ops" / "kda" / "naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLA = _load_fla_naive()
needs_fla = pytest.mark.skipif(FLA is None, reason="fla-core (the test extra) is not installed")


def _core_inputs(T, H, K, seed):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, H, K, generator=g)
    gate = -5.0 * torch.sigmoid(torch.randn(T, H, K, generator=g) * 2)
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    state = torch.randn(H, K, K, generator=g) * 0.5                            # [H, V, K]
    return q, k, v, gate, beta, state


@needs_fla
@pytest.mark.parametrize("T,H,K", [(63, 2, 16), (1, 3, 8), (100, 1, 32)], ids=["T63", "T1", "T100"])
def test_recurrent_matches_fla_naive_recurrent(T, H, K):
    q, k, v, gate, beta, state = _core_inputs(T, H, K, seed=T)
    o, final = kda_recurrent(q, k, v, gate, beta, state, scale=K ** -0.5)
    # fla keeps the state K-first: [B, H, K, V].
    o_ref, s_ref = FLA.naive_recurrent_kda(q[None], k[None], v[None], gate[None], beta[None], scale=K ** -0.5,
                                           initial_state=state.transpose(1, 2)[None], output_final_state=True)
    torch.testing.assert_close(o, o_ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, s_ref[0].transpose(1, 2), rtol=1e-5, atol=1e-5)


@needs_fla
@pytest.mark.parametrize("T,chunk", [(64, 16), (96, 32)], ids=["T64-c16", "T96-c32"])
def test_recurrent_matches_fla_naive_chunk(T, chunk):
    q, k, v, gate, beta, state = _core_inputs(T, 2, 16, seed=T + 1)
    o, final = kda_recurrent(q, k, v, gate, beta, state, scale=0.25)
    o_ref, s_ref = FLA.naive_chunk_kda(q[None], k[None], v[None], gate[None], beta[None], scale=0.25,
                                       initial_state=state.transpose(1, 2)[None], output_final_state=True,
                                       chunk_size=chunk)
    torch.testing.assert_close(o, o_ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, s_ref[0].transpose(1, 2), rtol=1e-4, atol=1e-4)


def test_gates_match_fla_formulas():
    g = torch.Generator().manual_seed(0)
    H, K = 3, 8
    raw, A_log, dt_bias = torch.randn(50, H, K, generator=g) * 3, torch.randn(H, generator=g), torch.randn(H * K, generator=g)
    # Re-derived from fla/ops/kda/gate.py (not importable without triton): naive_kda_lowerbound_gate is
    # lower_bound * sigmoid(exp(A_log).view(H, 1) * (g + dt_bias.view(H, -1))).
    lb_ref = -5.0 * torch.sigmoid(A_log.view(H, 1).exp() * (raw + dt_bias.view(H, -1)))
    torch.testing.assert_close(kda_gate(raw, A_log, dt_bias, lower_bound=-5.0), lb_ref)
    # ... and naive_kda_gate is -exp(A_log).view(H, 1) * softplus(g + dt_bias.view(H, -1)).
    sp_ref = -A_log.view(H, 1).exp() * F.softplus(raw + dt_bias.view(H, -1))
    torch.testing.assert_close(kda_gate(raw, A_log, dt_bias, lower_bound=None), sp_ref)
    assert (lb_ref > -5).all() and (lb_ref < 0).all()


def _weights(hidden, H, K, low_rank, seed, W=4):
    g = torch.Generator().manual_seed(seed)
    D = H * K

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    w = dict(q=r(D, hidden, s=hidden ** -0.5), k=r(D, hidden, s=hidden ** -0.5), v=r(D, hidden, s=hidden ** -0.5),
             f_a=r(K, hidden, s=hidden ** -0.5), b=r(H, hidden, s=hidden ** -0.5),
             conv=r(3 * D, W, s=0.5), f_b=r(D, K, s=K ** -0.5), A_log=r(H, s=0.5), dt_bias=r(D, s=0.5),
             o_norm=torch.rand(D // H, generator=g) + 0.5, o=r(hidden, D, s=D ** -0.5))
    w["g_a"] = r(K if low_rank else D, hidden, s=hidden ** -0.5)
    w["g_b"] = r(D, K, s=K ** -0.5) if low_rank else None
    return w


def _plugin_args(w):
    in_proj = torch.cat([w["q"], w["k"], w["v"], w["f_a"], w["b"], w["g_a"]])
    return (in_proj, w["conv"], w["f_b"], w["A_log"], w["dt_bias"], w["g_b"], w["o_norm"], w["o"])


def _naive_mixer(x, w, H, K, lower_bound, eps):
    """One whole sequence from zero state, HF-style: F.conv1d over q|k|v, fla's naive recurrence."""
    T = x.shape[0]
    W = w["conv"].shape[1]
    qkv = torch.cat([x @ w["q"].T, x @ w["k"].T, x @ w["v"].T], dim=-1).T[None]       # [1, 3D, T]
    y = F.silu(F.conv1d(qkv, w["conv"][:, None, :], padding=W - 1, groups=qkv.shape[1])[..., :T])[0].T
    q, k, v = (t.reshape(T, H, K) for t in y.chunk(3, dim=-1))
    l2 = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)
    raw = ((x @ w["f_a"].T) @ w["f_b"].T).view(T, H, K) + w["dt_bias"].view(H, K)
    rate = w["A_log"].exp().view(H, 1)
    gate = -rate * F.softplus(raw) if lower_bound is None else lower_bound * torch.sigmoid(rate * raw)
    beta = torch.sigmoid(x @ w["b"].T)
    o, _ = FLA.naive_recurrent_kda(l2(q)[None], l2(k)[None], v[None], gate[None], beta[None], scale=K ** -0.5)
    o = o[0]
    og = x @ w["g_a"].T if w["g_b"] is None else (x @ w["g_a"].T) @ w["g_b"].T
    o = w["o_norm"] * o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * torch.sigmoid(og.view(T, H, K))
    return o.reshape(T, H * K) @ w["o"].T


def _pools(S, H, K, D, W=4, dtype=torch.float32):
    # NaN in every slot: a slot the call does not own must stay untouched and unread.
    return torch.full((S, H, K, K), float("nan"), dtype=dtype), torch.full((S, 3 * D, W - 1), float("nan"))


def _run(x, w, rec, conv, cu, slots, H, K, lb):
    return kda_mixer(x, *_plugin_args(w), rec, conv, cu_seqlens=torch.tensor(cu), slot_ids=torch.tensor(slots),
                     num_heads=H, head_dim=K, lower_bound=lb, eps=1e-5)


MIXER_CASES = {
    "T63-H2-K16-lb-fullrank": (63, 2, 16, -5.0, False),
    "T100-H3-K8-softplus-lowrank": (100, 3, 8, None, True),
    "T1-H1-K32-lb-lowrank": (1, 1, 32, -5.0, True),
}


@needs_fla
@pytest.mark.parametrize("T,H,K,lb,low_rank", MIXER_CASES.values(), ids=MIXER_CASES.keys())
def test_mixer_matches_naive(T, H, K, lb, low_rank):
    hidden = 40
    w = _weights(hidden, H, K, low_rank, seed=T)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(T + 9))
    rec, conv = _pools(3, H, K, H * K)
    rec[1], conv[1] = 0, 0
    out = _run(x, w, rec, conv, [0, T], [1], H, K, lb)
    torch.testing.assert_close(out, _naive_mixer(x, w, H, K, lb, 1e-5), rtol=1e-5, atol=1e-5)
    assert rec[[0, 2]].isnan().all() and conv[[0, 2]].isnan().all()
    # The conv slot holds the last 3 raw q|k|v inputs, oldest first (zeros before the sequence start).
    raw = torch.cat([x @ w["q"].T, x @ w["k"].T, x @ w["v"].T], dim=-1)
    tail = torch.cat([torch.zeros(3, raw.shape[1]), raw])[-3:].T
    torch.testing.assert_close(conv[1], tail, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("piece", [1, 7, 100], ids=["piece1", "piece7", "whole"])
def test_chunked_prefill_invariance(piece):
    T, H, K, hidden = 100, 2, 16, 40
    w = _weights(hidden, H, K, False, seed=3)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(4))
    rec_a, conv_a = _pools(2, H, K, H * K)
    rec_a[1], conv_a[1] = 0, 0
    whole = _run(x, w, rec_a, conv_a, [0, T], [1], H, K, -5.0)
    rec_b, conv_b = _pools(2, H, K, H * K)
    rec_b[1], conv_b[1] = 0, 0
    outs = [_run(x[s:s + piece], w, rec_b, conv_b, [0, min(piece, T - s)], [1], H, K, -5.0)
            for s in range(0, T, piece)]
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rec_b, rec_a, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(conv_b, conv_a, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_ragged_batch_equals_each_alone():
    H, K, hidden = 2, 8, 32
    lens, slots = [5, 1, 0, 63, 17], [4, 0, 6, 2, 5]
    w = _weights(hidden, H, K, True, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(sum(lens), hidden, generator=gen)
    rec, conv = _pools(7, H, K, H * K)
    # Sequences continue from earlier chunks: random non-zero slot contents.
    for s in slots:
        rec[s], conv[s] = torch.randn(H, K, K, generator=gen) * 0.3, torch.randn(3 * H * K, 3, generator=gen)
    rec_alone, conv_alone = rec.clone(), conv.clone()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    batched = _run(x, w, rec, conv, cu, slots, H, K, -5.0)
    alone = [_run(x[cu[i]:cu[i + 1]], w, rec_alone, conv_alone, [0, lens[i]], [slots[i]], H, K, -5.0)
             for i in range(len(lens))]
    torch.testing.assert_close(batched, torch.cat(alone), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rec, rec_alone, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(conv, conv_alone, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert rec[[1, 3]].isnan().all() and conv[[1, 3]].isnan().all()


@needs_fla
def test_mixer_bf16_smoke_with_bf16_state():
    T, H, K, hidden = 63, 2, 16, 40
    w = _weights(hidden, H, K, False, seed=7)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(8))
    wb = {n: (t if n in ("conv", "A_log", "dt_bias", "o_norm") or t is None else t.bfloat16()) for n, t in w.items()}
    # fp32 math on the same bf16-rounded inputs: what is left is the op's own bf16 rounding.
    ref = _naive_mixer(x.bfloat16().float(), {n: t if t is None else t.float() for n, t in wb.items()}, H, K, -5.0, 1e-5)
    rec = torch.zeros(1, H, K, K, dtype=torch.bfloat16)
    conv = torch.zeros(1, 3 * H * K, 3, dtype=torch.bfloat16)
    out = _run(x.bfloat16(), wb, rec, conv, [0, T], [0], H, K, -5.0)
    assert out.dtype == torch.bfloat16 and rec.dtype == torch.bfloat16 and not rec.isnan().any()
    # The spec's parity bar (K3_SPEC.md §4.5): cosine > 0.999, rel-L2 < 3e-2.
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0) > 0.999
    assert (out.float() - ref).norm() / ref.norm() < 3e-2


def test_mixer_takes_the_builds_padded_in_proj():
    """The layout pass pads in_proj with zero rows to a multiple of IN_PROJ_ROW_ALIGN: same output and states as
    unpadded."""
    T, H, K, hidden = 9, 3, 8, 24
    w = _weights(hidden, H, K, True, seed=3)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(4))
    args = list(_plugin_args(w))
    rows, padded = in_proj_rows(H, K, low_rank_gate=True)
    assert args[0].shape[0] == rows and padded % IN_PROJ_ROW_ALIGN == 0 and padded > rows
    outs = []
    for in_proj in (args[0], torch.cat([args[0], torch.zeros(padded - rows, hidden)])):
        rec, conv = torch.zeros(2, H, K, K), torch.zeros(2, 3 * H * K, 3)
        out = kda_mixer(x, in_proj, *args[1:], rec, conv, cu_seqlens=torch.tensor([0, 4, T]),
                        slot_ids=torch.tensor([1, 0]), num_heads=H, head_dim=K, lower_bound=-5.0, eps=1e-5)
        outs.append((out, rec, conv))
    for a, b in zip(*outs):  # equal up to the GEMM's blocking (an fp32 ulp): a misread column would be O(1)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mixer_rejects_bad_input():
    H, K, hidden = 2, 8, 16
    w = _weights(hidden, H, K, False, seed=0)
    x = torch.randn(6, hidden)
    rec, conv = _pools(3, H, K, H * K)
    with pytest.raises(ValueError, match="slot_ids must be distinct"):
        _run(x, w, rec, conv, [0, 3, 6], [1, 1], H, K, -5.0)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to 6"):
        _run(x, w, rec, conv, [0, 4], [1], H, K, -5.0)
    with pytest.raises(ValueError, match="in_proj_weight must be"):
        _run(x, w, rec, conv, [0, 6], [1], 4, 4, -5.0)


@pytest.mark.parametrize("N,H,bv", [(32, 6, 32), (128, 6, 32), (8, 96, 32), (64, 96, 128), (256, 96, 128)])
def test_split_decode_slice_by_grid(N, H, bv):
    """The H200 sweeps' winners (BENCHMARKS.md): narrow slices while sequences x heads are few, wide ones past."""
    pytest.importorskip("triton")
    from k3plugins.kda.fla import decode_block_v
    assert decode_block_v(N, H) == bv


@pytest.mark.parametrize("N,H,capped", [(32, 6, False), (64, 6, True), (128, 6, False), (8, 96, False),
                                        (64, 96, False), (44, 6, False), (45, 6, True), (66, 6, True), (67, 6, False)])
def test_fused_decode_cap_by_grid(N, H, capped):
    """The H200 sweep's winners (BENCHMARKS.md): the 168-register cap (three programs an SM) only where the grid
    fits three programs on each of 132 SMs but not two; with 2 a SM at most 264 programs, with 3 at most 396."""
    pytest.importorskip("triton")
    from k3plugins.kda.fla import FUSED_MAXNREG, fused_maxnreg
    assert fused_maxnreg(N * H, 132) == (FUSED_MAXNREG if capped else 0)
