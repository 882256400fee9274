"""The batched sampler: its noise is SplitMix64 bit for bit, each row's draw depends on its own seed and logits
alone (not on the batch), the masks keep exactly the tokens top-k / top-p name, and the draws follow the masked
distribution."""
import math

import pytest
import torch

from k3runtime.sampler import (_draw_full, _draw_seed, _draw_top_k, _i64, _Rows, _splitmix64, gumbel_noise,
                               sample)
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


def test_draws_follow_the_distribution():
    """2000 seeds on a four-token distribution: each frequency within 4 standard errors of its probability, with
    the temperature applied."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.log(probs)[None] * 2.0  # temperature 2 undoes the doubling
    n = 2000
    counts = torch.bincount(torch.tensor([sample(logits, [SamplingParams(temperature=2.0)], [s], [7])[0]
                                          for s in range(n)]), minlength=4).float()
    se = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() < 4 * se).all(), counts / n


def test_top_k_rows_draw_as_the_full_pass_does():
    """Rows that all have a top-k take the k-best path; on logits without ties it draws exactly the tokens the
    full-vocabulary pass draws, with top-p on top, over many seeds."""
    g = torch.Generator().manual_seed(5)
    M, V = 6, 300
    ks = [1, 3, 7, 20, 50, 300]
    for trial in range(20):
        x = torch.randn(M, V, generator=g) * (1 + trial % 3)
        rows = _Rows(k=torch.tensor(ks), top_p=torch.tensor([1.0, 0.5, 0.9, 0.3, 1.0, 0.95]),
                     draw_seeds=torch.tensor([_draw_seed(trial, m) for m in range(M)]), kmax=max(ks),
                     any_top_p=trial % 2 == 0)
        if not rows.any_top_p:
            rows.top_p = torch.ones(M)
        assert torch.equal(_draw_top_k(x, rows), _draw_full(x, rows)), trial


def test_a_row_draws_alike_whichever_path_its_batch_takes():
    """The same row (top-k and top-p) beside a row with a top-k (the k-best path, kmax from the batch) and beside a
    row without one (the full pass): the same token for every seed."""
    g = torch.Generator().manual_seed(9)
    row = SamplingParams(temperature=0.9, top_k=40, top_p=0.7)
    fast_mate, full_mate = SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.9)
    for trial in range(5):
        logits = torch.randn(2, 5000, generator=g) * 2
        for s in range(40):
            fast = sample(logits, [row, fast_mate], [s, 1], [trial, 0])[0]
            full = sample(logits, [row, full_mate], [s, 1], [trial, 0])[0]
            assert fast == full == sample(logits[:1], [row], [s], [trial])[0], (trial, s)
