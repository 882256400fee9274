"""The batched sampler on the GPU (pytest -m gpu): the same tokens as on the CPU for the same logits (its noise is
integer hashing, the same on any device), and a whole batch sampled with one device->host sync, the token ids'."""
import pytest
import torch

from k3runtime.sampler import sample
from k3runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
          SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8)]


@pytest.mark.parametrize("triton", [(False, False), (True, False), (True, True)],
                         ids=["torch_ops", "triton_draw", "triton_draw_and_top_p"])
@pytest.mark.parametrize("top_k_only", [False, True], ids=["full", "top_k_rows"])
def test_gpu_draws_equal_cpu_draws(top_k_only, triton, monkeypatch):
    from k3runtime import sampler
    monkeypatch.setattr(sampler, "TRITON_DRAW", triton[0])
    monkeypatch.setattr(sampler, "TRITON_TOP_P", triton[1])
    g = torch.Generator().manual_seed(3)
    params = [p for p in PARAMS if p.top_k or p.temperature == 0] if top_k_only else PARAMS
    M = len(params)
    logits = torch.randn(M, 4096, generator=g) * 4  # gaps far above fp32 rounding between devices
    for trial in range(10):
        seeds, positions = [trial * 10 + m for m in range(M)], [trial] * M
        assert sample(logits.cuda(), params, seeds, positions) == sample(logits, params, seeds, positions), trial


def test_one_sync_for_the_batch():
    """Under torch's sync debug mode every device->host sync warns; sampling 32 rows makes one (the token ids)."""
    import warnings
    logits = torch.randn(32, 4096, device="cuda")
    params = [PARAMS[i % len(PARAMS)] for i in range(32)]
    sample(logits, params, list(range(32)), [0] * 32)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sample(logits, params, list(range(32)), [0] * 32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message)[:100] for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, syncs  # the token ids to the host; the parameters go up without one


def test_penalties_on_the_gpu_equal_the_cpu_and_never_sync():
    """Bias, penalties and bans over 40 rows (two passes), a pending token on the device for some, then a step of one
    token more a row on the counts kept by slot: the CPU's values, with no device->host sync at all (sync debug
    mode "error", the counts allocated inside it)."""
    from k3runtime.penalties import SeenCounts, adjust_logits
    from k3runtime.scheduler import SeenTokens

    g = torch.Generator().manual_seed(5)
    V, M = 4096, 40
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                             logit_bias={i: 3.0, 7: -100.0}) if i % 3 else SamplingParams() for i in range(M)]
    seen = [SeenTokens(tuple(range(i, i + 5)), tuple(torch.randint(0, V, (i,), generator=g).tolist()))
            if p.penalized else None for i, p in enumerate(params)]
    pending = torch.randint(0, V, (M,), generator=g).masked_fill(torch.arange(M) % 2 == 0, -1)
    banned = [(2, 9) if i % 4 == 0 else () for i in range(M)]  # min_tokens' EOS and stop ids
    logits = torch.randn(M, V, generator=g) * 4
    want = adjust_logits(logits, params, seen, pending, banned)
    assert torch.isinf(want[0, [2, 9]]).all()
    # the next step: each penalized row brings one more token, its counts kept on the device (SeenCounts)
    more = [None if t is None else SeenTokens((), (i % V,), len(t.output), fresh=False) for i, t in enumerate(seen)]
    cpu_store = SeenCounts()
    adjust_logits(logits, params, seen, pending, banned, store=cpu_store)
    want_next = adjust_logits(logits, params, more, pending, banned, store=cpu_store)
    on_gpu, late = logits.cuda(), pending.cuda()
    adjust_logits(on_gpu, params, seen, late, banned)  # warm-up
    store = SeenCounts()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = adjust_logits(on_gpu, params, seen, late, banned, store=store)
        got_next = adjust_logits(on_gpu, params, more, late, banned, store=store)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_next.cpu(), want_next, rtol=1e-6, atol=1e-6)
    assert not torch.equal(want_next, want)


def test_triton_draw_equals_the_torch_ops():
    """The one-launch draw (k3plugins.sample) against the sampler's torch ops on the same GPU: K3's vocabulary, 130
    rows (chunked rows, a ragged last block), logits rounded to bf16 (ties), -inf tokens, many seeds."""
    from k3runtime.sampler import _draw_seed, _triton, gumbel_noise
    draw = _triton("gumbel_argmax")
    assert draw is not None
    g = torch.Generator(device="cuda").manual_seed(2)
    V = 163840
    ids = torch.arange(V, device="cuda")
    for trial in range(5):
        x = (torch.randn(130, V, device="cuda", generator=g) * 3).bfloat16().float()
        x[::7, ::5] = float("-inf")
        seeds = torch.tensor([_draw_seed(trial, m) for m in range(130)], dtype=torch.int64, device="cuda")
        assert torch.equal(draw(x, seeds), (x + gumbel_noise(seeds, ids)).argmax(dim=-1)), trial


@pytest.mark.parametrize("listed", [False, True], ids=["rows", "listed"])
@pytest.mark.parametrize("kind", ["bf16_ties", "fp32", "masked", "flat"])
def test_triton_top_p_keeps_what_the_sort_keeps(kind, listed, monkeypatch):
    """Top-p by Triton's histograms (k3plugins.sample.top_p) against the sampler's sort on the same GPU, bit for bit:
    K3's vocabulary, 40 rows (a chunked grid), logits rounded to bf16 (ties, also at the cut), -inf tokens, nearly
    flat rows (the cut deep in the vocabulary); top_p at 1, tiny, just under 1 and random; with no sync. The later
    rounds on the rows, and on the list of the first round's bucket (the form from LIST_MIN_ROWS rows on)."""
    from k3plugins.sample import top_p as tp
    from k3runtime.sampler import _triton, top_p_keep
    top_p_filter = _triton("top_p_filter")
    assert top_p_filter is not None
    monkeypatch.setattr(tp, "LIST_MIN_ROWS", 1 if listed else 10**9)
    g = torch.Generator(device="cuda").manual_seed(4)
    M, V = 40, 163840
    for trial in range(3):
        x = torch.randn(M, V, device="cuda", generator=g) * (0.01 if kind == "flat" else 3.0 / (trial + 1))
        if kind == "bf16_ties":
            x = x.bfloat16().float()
        elif kind == "masked":
            x = x.masked_fill(torch.rand(M, V, device="cuda", generator=g) < 0.9, float("-inf"))
            x[:, trial] = 0.5
        top_p = torch.rand(M, device="cuda", generator=g, dtype=torch.float64)
        top_p[:3] = torch.tensor([1.0, 1e-46, 1 - 1e-9], dtype=torch.float64)
        want = x.masked_fill(~top_p_keep(x, top_p), float("-inf"))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = top_p_filter(x, top_p)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (trial, int((got != want).sum()))


@pytest.mark.parametrize("listed", [False, True], ids=["rows", "listed"])
def test_triton_top_p_tie_weight_to_the_last_unit(listed, monkeypatch):
    """Rows of K3's vocabulary whose cut falls among ties to the last unit (tests/top_p_rows.py): the GPU's fp64 exp
    of the tie weight (taken once a row) against the sort's."""
    from top_p_rows import tie_weight_rows

    from k3plugins.sample import top_p as tp
    from k3runtime.sampler import _triton, top_p_keep
    monkeypatch.setattr(tp, "LIST_MIN_ROWS", 1 if listed else 10**9)
    x, top_p = (t.cuda() for t in tie_weight_rows(163840))
    want = x.masked_fill(~top_p_keep(x, top_p), float("-inf"))
    assert set((want[:, 1:9] > float("-inf")).sum(1).tolist()) == {2, 3}  # the one step moves the cut
    got = _triton("top_p_filter")(x, top_p)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
