"""Turn logits into tokens: greedy, temperature, top-k, top-p, each draw seeded by (request seed, position).

Seeding every draw by the request's seed and the index of the token being sampled makes sampling a pure
function of the request, so batch composition and preemption-by-recompute cannot change the output.

The whole batch is sampled in one pass of tensor ops on the logits' device, with one device->host copy (the
token ids) at the end: rows are masked by their own top-k and top-p, then drawn by the Gumbel-max trick,
argmax(x + g) over the tokens left (x the tempered logits), where g comes from a counter-based hash of (the row's
draw seed, the token id). The noise of a row is thus a function of its seed alone, the same on any device and in
any batch. (A torch.Generator a row would need a launch sequence and a host sync a row.) When every sampled row
has a top-k, the rows are drawn from their k best logits only (_draw_top_k): the same masks and noise, so the
same tokens, without sorting the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby (seed, position) pairs apart


def _draw_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def _i64(c: int) -> int:
    """A 64-bit constant as the signed int64 holding its bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> sign-extends)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 bits (products wrap mod 2^64, as uint64 ones do)."""
    x = x + _i64(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _i64(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _i64(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def gumbel_noise(draw_seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise fp32 for token ids `ids` ([V], or [M, k]) of rows with draw seeds `draw_seeds` [M]
    (int64): [M, V] or [M, k], each value a function of (its row's seed, its token id) alone."""
    ids = ids if ids.dim() == 2 else ids[None, :]
    bits = _splitmix64(draw_seeds[:, None] ^ (ids * _i64(0xD1B54A32D192ED03)))
    u = (_shr(bits, 40).to(torch.float32) + 0.5) * 2.0 ** -24  # 24 random bits, strictly inside (0, 1)
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """Args: logits [M, V] fp32; per row its params, request seed and output-token index. Returns M token ids (the
    one device->host sync)."""
    greedy = logits.argmax(dim=-1)
    hot = [p.temperature > 0 for p in params]
    if not any(hot):
        return greedy.tolist()
    dev, V = logits.device, logits.shape[1]
    ks = [min(p.top_k, V) for p in params]
    # the rows' parameters in two uploads, neither a sync (small pageable copies)
    floats = torch.tensor([[p.temperature if p.temperature > 0 else 1.0, p.top_p] for p in params])
    ints = torch.tensor([[k, h, _draw_seed(s, pos)] for k, h, s, pos in zip(ks, hot, seeds, positions)],
                        dtype=torch.int64)
    floats, ints = floats.to(dev, non_blocking=True), ints.to(dev, non_blocking=True)
    x = logits.float() / floats[:, :1]
    rows = _Rows(k=ints[:, 0], top_p=floats[:, 1], draw_seeds=ints[:, 2], kmax=max(ks),
                 any_top_p=any(p.top_p < 1.0 for p in params))
    if all(k or not h for k, h in zip(ks, hot)):  # every sampled row has a top-k: work on its k best only
        drawn = _draw_top_k(x, rows)
    else:
        drawn = _draw_full(x, rows)
    return torch.where(ints[:, 1].bool(), drawn, greedy).tolist()


@dataclass
class _Rows:
    """The rows' sampling parameters on the logits' device (k: top-k, 0 off; top_p: 1.0 off), and two facts about
    them known on the host."""
    k: torch.Tensor
    top_p: torch.Tensor
    draw_seeds: torch.Tensor
    kmax: int
    any_top_p: bool


def _top_p_drop(sorted_x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Of each row's tempered logits sorted descending (-inf past its top-k), those past the smallest prefix whose
    probability mass reaches the row's top_p (the first always stays; rows at 1.0 keep all). The masses are summed
    unnormalised, in fp64, in the sorted order: a row's verdict does not depend on how many -inf columns the batch
    gave it (the two paths below, other rows' top-k)."""
    w = torch.exp((sorted_x - sorted_x[:, :1]).double())  # the row's max first: weights in (0, 1], -inf -> 0
    cum = w.cumsum(-1)
    return (cum - w >= top_p.double()[:, None] * cum[:, -1:]) & (top_p < 1.0)[:, None]


def _kth(vals: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest value [M, 1] from its top values sorted descending (-inf where k is 0: no top-k)."""
    kth = vals.gather(1, (k.clamp(min=1) - 1)[:, None])
    return kth.masked_fill((k == 0)[:, None], float("-inf"))


def _draw_full(x: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """Tokens [M] drawn over the whole vocabulary: each row masked by its top-k (ties at the k-th kept) and top-p,
    then argmax(x + Gumbel noise) over what is left (Gumbel-max needs no normalising: log p differs from x by a
    constant a row)."""
    if rows.kmax:
        x = x.masked_fill(x < _kth(torch.topk(x, rows.kmax, dim=-1).values, rows.k), float("-inf"))
    if rows.any_top_p:
        sorted_x, order = x.sort(dim=-1, descending=True)
        x = x.scatter(1, order, sorted_x.masked_fill(_top_p_drop(sorted_x, rows.top_p), float("-inf")))
    ids = torch.arange(x.shape[1], device=x.device)
    return (x + gumbel_noise(rows.draw_seeds, ids)).argmax(dim=-1)


def _draw_top_k(x: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """_draw_full's tokens for rows that all have a top-k (greedy rows: any k), from each row's kmax best logits:
    the same masks and the same noise a token id, so the same draws, without a pass over the vocabulary past the
    top-k. Ties at a row's k-th value beyond kmax are the one difference (the full pass keeps them)."""
    vals, ids = torch.topk(x, rows.kmax, dim=-1)                               # descending
    vals = vals.masked_fill(vals < _kth(vals, rows.k), float("-inf"))          # ties at the k-th stay, as in full
    if rows.any_top_p:
        vals = vals.masked_fill(_top_p_drop(vals, rows.top_p), float("-inf"))
    best = (vals + gumbel_noise(rows.draw_seeds, ids)).argmax(dim=-1)
    return ids.gather(1, best[:, None])[:, 0]
