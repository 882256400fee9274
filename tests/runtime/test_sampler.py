"""The batched sampler: its noise is SplitMix64 bit for bit, each row's draw depends on its own seed and logits
alone (not on the batch), the masks keep exactly the tokens top-k / top-p name, and the draws follow the masked
distribution."""
import math

import pytest
import torch

from k3runtime.sampler import (_draw_full, _draw_seed, _draw_top_k, _i64, _Rows, _splitmix64, _uniform,
                               gumbel_noise, min_p_keep, sample, top_p_keep)
from k3runtime.sampling_params import SamplingParams

M64 = (1 << 64) - 1


def _splitmix64_ref(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def test_noise_hash_is_splitmix64_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    xs = [0, 1, (1 << 63) - 1, 1 << 62, 12345678901234567] + torch.randint(0, 1 << 62, (50,), generator=g).tolist()
    got = _splitmix64(torch.tensor([_i64(x) for x in xs], dtype=torch.int64)).tolist()
    assert [v & M64 for v in got] == [_splitmix64_ref(x) for x in xs]


def test_every_uniform_is_strictly_inside_0_1():
    """All 2^23 values the noise's uniform can take: none is 0 or 1 (whose noise would be infinite)."""
    u = _uniform(torch.arange(1 << 23, dtype=torch.int64) << 41)
    assert u.min() > 0 and u.max() < 1 and torch.isfinite(-torch.log(-torch.log(u))).all()
    assert u.unique().numel() == 1 << 23


def test_noise_is_gumbel_and_a_function_of_the_seed():
    seeds = torch.tensor([_draw_seed(s, 0) for s in (1, 2, 1)], dtype=torch.int64)
    g = gumbel_noise(seeds, torch.arange(20000))
    assert torch.equal(g[0], g[2]) and not torch.equal(g[0], g[1])
    # standard Gumbel: mean = Euler's gamma, variance = pi^2 / 6 (20000 draws: a few % at most)
    assert abs(g[1].mean().item() - 0.5772) < 0.03 and abs(g[1].var().item() - math.pi ** 2 / 6) < 0.08
    assert torch.isfinite(g).all()


def _kept_reference(logits_row, p):
    """The tokens the per-row sampler this one replaced could draw (its masks, one row at a time)."""
    x = logits_row.float() / p.temperature
    if p.top_k:
        kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return set(torch.nonzero(probs > 0).flatten().tolist())


PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3),
          SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(temperature=0.9, top_k=5, top_p=0.8),
          SamplingParams(temperature=2.0, top_k=1)]


def test_each_row_is_drawn_as_if_alone():
    """A row's token does not depend on the other rows of the batch, nor on its place in it."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), 50, generator=g) * 3
    seeds, positions = [11, 12, 13, 14, 15, 16], [0, 3, 5, 7, 9, 11]
    batched = sample(logits, PARAMS, seeds, positions)
    alone = [sample(logits[i:i + 1], [p], [s], [q])[0] for i, (p, s, q) in enumerate(zip(PARAMS, seeds, positions))]
    order = [5, 2, 0, 4, 1, 3]
    shuffled = sample(logits[order], [PARAMS[i] for i in order], [seeds[i] for i in order],
                      [positions[i] for i in order])
    assert batched == alone == [shuffled[order.index(i)] for i in range(len(PARAMS))]
    assert batched[0] == int(logits[0].argmax())  # greedy
    assert batched[5] == int(logits[5].argmax())  # top_k=1 at any temperature


@pytest.mark.parametrize("row", range(1, len(PARAMS)))
def test_draws_stay_inside_the_masks_and_cover_them(row):
    g = torch.Generator().manual_seed(row)
    logits = torch.randn(1, 12, generator=g)
    p = PARAMS[row]
    kept = _kept_reference(logits[0], p)
    drawn = {sample(logits, [p], [s], [0])[0] for s in range(400)}
    assert drawn <= kept  # nothing outside top-k / top-p
    probs = torch.softmax(logits[0] / p.temperature, -1)
    likely = {t for t in kept if probs[t] / sum(probs[k] for k in kept) > 0.05}
    assert likely <= drawn  # every token kept with more than 5 % of the mass came up in 400 draws


@pytest.mark.parametrize("kw,want", [({}, [0.4, 0.3, 0.2, 0.1]), ({"top_k": 3}, [4 / 9, 3 / 9, 2 / 9, 0.0]),
                                     ({"top_p": 0.65}, [4 / 7, 3 / 7, 0.0, 0.0]),
                                     ({"top_k": 3, "top_p": 0.8}, [4 / 9, 3 / 9, 2 / 9, 0.0]),
                                     ({"min_p": 0.3}, [4 / 9, 3 / 9, 2 / 9, 0.0]),
                                     # min-p before top-p (vLLM's V1 order): top-p's mass is of min-p's kept tokens
                                     # (7/9 >= 0.75 drops the third; top-p first would keep it: 0.7 < 0.75)
                                     ({"min_p": 0.3, "top_p": 0.75}, [4 / 7, 3 / 7, 0.0, 0.0]),
                                     ({"min_p": 0.6, "top_k": 3}, [4 / 7, 3 / 7, 0.0, 0.0])], ids=str)
def test_draws_follow_the_distribution(kw, want):
    """2000 seeds on a four-token distribution, with the temperature applied and the masks renormalised: each
    frequency within 4 standard errors of its probability (0 exactly where masked)."""
    probs, want = torch.tensor([0.4, 0.3, 0.2, 0.1]), torch.tensor(want)
    logits = torch.log(probs)[None] * 2.0  # temperature 2 undoes the doubling
    n = 2000
    counts = torch.bincount(torch.tensor([sample(logits, [SamplingParams(temperature=2.0, **kw)], [s], [7])[0]
                                          for s in range(n)]), minlength=4).float()
    se = (want * (1 - want) / n).sqrt()
    assert ((counts / n - want).abs() <= 4 * se).all(), counts / n


def _rows(ks, top_p, seeds, kmax=None, min_p=None):
    return _Rows(k=torch.tensor(ks), top_p=torch.tensor(top_p, dtype=torch.float64), draw_seeds=torch.tensor(seeds, dtype=torch.int64),
                 kmax=kmax or max(ks), any_top_k=any(ks), any_top_p=any(t < 1.0 for t in top_p),
                 min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float64))


@pytest.mark.parametrize("ties", [False, True], ids=["fp32", "bf16_ties"])
def test_top_k_rows_draw_as_the_full_pass_does(ties):
    """Rows that all have a top-k take the k-best path: it draws exactly the full pass's tokens, top-p on top, over
    many seeds, also on logits rounded to bf16 (ties everywhere, at the k-th value and inside the top-p prefix) and
    with a larger window than the batch needs (another row's top-k)."""
    g = torch.Generator().manual_seed(5)
    M, V = 6, 300
    ks = [1, 3, 7, 20, 50, 300]
    for trial in range(20):
        x = torch.randn(M, V, generator=g) * (1 + trial % 3)
        if ties:
            x = (x * 4).round() / 4  # a few dozen distinct values a row
        top_p = [1.0, 0.5, 0.9, 0.3, 1.0, 0.95] if trial % 2 else [1.0] * M
        min_p = [0.0, 0.1, 0.0, 0.05, 0.3, 0.01] if trial % 4 > 1 else None
        seeds = [_draw_seed(trial, m) for m in range(M)]
        full = _draw_full(x, _rows(ks, top_p, seeds, min_p=min_p))
        assert torch.equal(_draw_top_k(x, _rows(ks, top_p, seeds, min_p=min_p)), full), trial
        small = [min(k, 20) for k in ks]
        assert torch.equal(_draw_top_k(x, _rows(small, top_p, seeds, kmax=40, min_p=min_p)),
                           _draw_full(x, _rows(small, top_p, seeds, min_p=min_p))), trial


def test_top_k_keeps_exactly_k_with_ties_broken_by_id():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    for k, want in ((1, {1}), (2, {1, 3}), (3, {1, 3, 2}), (4, {1, 3, 2, 4}), (7, set(range(7)))):
        drawn = {int(_draw_full(x, _rows([k], [1.0], [s]))) for s in range(300)}
        assert drawn == want, (k, drawn)


@pytest.mark.parametrize("ties", [False, True], ids=["fp32", "bf16_ties"])
def test_a_row_draws_alike_whichever_path_its_batch_takes(ties):
    """The same row (top-k and top-p) beside a row with a top-k (the k-best path, the window from the batch), beside
    a row without one (the full pass) and alone: the same token for every seed, on logits with ties too."""
    g = torch.Generator().manual_seed(9)
    row = SamplingParams(temperature=0.9, top_k=40, top_p=0.7)
    mates = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_k=200),
             SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.0)]
    for trial in range(4):
        logits = torch.randn(2, 5000, generator=g) * 2
        if ties:
            logits = logits.bfloat16().float()
        for s in range(30):
            alone = sample(logits[:1], [row], [s], [trial])[0]
            for mate in mates:
                assert sample(logits, [row, mate], [s, 1], [trial, 0])[0] == alone, (trial, s, mate)


def test_edge_parameters_and_rows():
    """A top_p below fp32's range keeps the best token alone; a temperature under MIN_TEMPERATURE is greedy; a row
    of -inf logits takes its greedy token, alone or in a batch (nothing to draw from)."""
    logits = torch.zeros(1, 16)
    logits[0, 5], logits[0, 9] = 3.0, -1.0
    for s in range(20):
        assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-46)], [s], [0]) == [5]
        assert sample(torch.tensor([[3.0, 5.0, 0.0, -2.0]]), [SamplingParams(temperature=1e-50, top_k=1)], [s],
                      [0]) == [1]
    dead = torch.full((2, 16), float("-inf"))
    dead[1] = torch.randn(16)
    want = sample(dead[:1], [SamplingParams(temperature=1.0, top_k=3)], [0], [0])
    assert want == [int(dead[0].argmax())]
    for mate in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2)):
        assert sample(dead, [SamplingParams(temperature=1.0, top_k=3), mate], [0, 1], [0, 0])[0] == want[0]


def test_top_p_cut_at_an_exact_mass():
    """Where the mass before a token equals top_p of the total exactly, that token goes (the sort's >=): four equal
    tokens at top_p 0.5 keep the two lowest ids, at 0.75 three; a higher token first shifts it by one."""
    x = torch.zeros(3, 4)
    x[2, 3] = 10.0
    top_p = torch.tensor([0.5, 0.75, 0.5], dtype=torch.float64)
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(top_p_keep(x, top_p), want)


def test_top_k_minus_one_is_off_as_in_vllm():
    """vLLM's SamplingParams (and this OpenAI server's top_k) take -1 for "all tokens": the Python API, the Triton
    model and `generate --top-k` build SamplingParams, which refused it."""
    assert SamplingParams(temperature=1.0, top_k=-1) == SamplingParams(temperature=1.0, top_k=0)
    assert SamplingParams(top_k=-1).top_k == 0
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert {sample(logits, [SamplingParams(top_k=-1)], [s], [0])[0] for s in range(300)} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match=r"top_k: expected an int >= 0 \(0 or -1 = off\), got -2"):
        SamplingParams(top_k=-2)


def test_min_p_keeps_exactly_the_tokens_at_or_above_min_p_times_the_best():
    """vLLM's min-p on the tempered distribution: a token whose probability is min_p times the best's, give or take
    1e-5 of it, is kept or dropped by that side; the draws cover the kept tokens and nothing else, whichever path."""
    ratio = torch.tensor([1.0, 0.5, 0.2 * (1 + 1e-5), 0.2 * (1 - 1e-5), 0.15, 0.01, 0.2 * (1 + 1e-5)])
    logits = torch.log(ratio)[None] * 2.0  # temperature 2 undoes the doubling: min-p acts on the tempered ones
    assert min_p_keep(logits / 2.0, torch.tensor([0.2], dtype=torch.float64)).tolist() == \
        [[True, True, True, False, False, False, True]]
    for extra in ({}, {"top_k": 7}):  # the full pass and the k-best one
        p = SamplingParams(temperature=2.0, min_p=0.2, **extra)
        assert {sample(logits, [p], [s], [0])[0] for s in range(400)} == {0, 1, 2, 6}, extra
    assert {sample(logits, [SamplingParams(temperature=2.0)], [s], [0])[0] for s in range(400)} >= {3, 4}
    # 1.0 keeps the best alone: the greedy token at any temperature; 0 keeps all
    assert {sample(logits, [SamplingParams(temperature=5.0, min_p=1.0)], [s], [0])[0] for s in range(100)} == {0}
    assert min_p_keep(logits, torch.tensor([0.0], dtype=torch.float64)).all()


def test_min_p_is_per_request_in_a_batch():
    """Rows of one batch each keep their own min-p's tokens; a row with min_p 0 (or greedy) beside them draws what
    it draws in a batch without min-p, for every seed."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=g) * 2
    rows = [SamplingParams(temperature=1.0, min_p=0.5), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.8, min_p=0.05), SamplingParams(temperature=0.0, min_p=0.9)]
    plain = [SamplingParams(temperature=1.0, min_p=0.5), SamplingParams(temperature=1.0)]
    for r, mp, t in ((0, 0.5, 1.0), (2, 0.05, 0.8)):
        x = logits[r] / t
        kept = set(torch.nonzero(torch.softmax(x, -1) >= mp * torch.softmax(x, -1).max()).flatten().tolist())
        drawn = {sample(logits, rows, [s, s, s, s], [1] * 4)[r] for s in range(300)}
        assert drawn == kept and len(kept) > 1, (r, drawn, kept)
    for s in range(100):
        got = sample(logits, rows, [s] * 4, [1] * 4)
        assert got[1] == sample(logits[1:2], [SamplingParams(temperature=1.0)], [s], [1])[0]
        assert got[1] == sample(logits[:2], plain[1:] + plain[1:], [s, s], [1, 1])[1]
        assert got[3] == int(logits[3].argmax())
        assert got[0] == sample(logits[:1], plain[:1], [s], [1])[0]


def test_min_p_out_of_range_is_refused():
    assert SamplingParams(min_p=1).min_p == 1.0 and SamplingParams().min_p == 0.0
    for bad in (-0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match=r"min_p: expected a number in \[0, 1\] \(0 = off\), got"):
            SamplingParams(min_p=bad)
