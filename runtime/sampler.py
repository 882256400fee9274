"""Turn logits into tokens: greedy, temperature, min-p, top-k, top-p, each draw seeded by (request seed, position).

Seeding every draw by the request's seed and the index of the token being sampled makes sampling a pure
function of the request, so batch composition and preemption-by-recompute cannot change the output.

The whole batch is sampled in one pass of tensor ops on the logits' device, with one device->host copy (the
token ids) at the end: rows are masked by their own min-p, top-k and top-p, then drawn by the Gumbel-max trick,
argmax(x + g) over the tokens left (x the tempered logits), where g comes from a counter-based hash of (the row's
draw seed, the token id). The noise of a row is thus a function of its seed alone, in any batch, and the same
bits on any device (its logarithms may differ in the last bit between devices). A torch.Generator a row, as
before, took a launch sequence and a host sync a row. Ties, common in logits upcast from bf16, are broken by
token id at every step, so that nothing depends on the order a sort or top-k returns. When every row of a pass
has a top-k, the rows are drawn from their kept tokens only (_draw_top_k): the same sets, order and noise, so the
same tokens. On a GPU the noise and the argmax are one Triton launch (TRITON_DRAW, k3plugins.sample), and top-p's
kept set comes from Triton's histograms instead of a sort (TRITON_TOP_P).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams
from .upload import to_device

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


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """23 of the hash's bits as fp32 uniforms strictly inside (0, 1): (n + 0.5) / 2^23 is exact in fp32 for every
    n < 2^23 (24 bits would round the largest up to 1.0, whose noise is +inf)."""
    return (_shr(bits, 41).to(torch.float32) + 0.5) * 2.0 ** -23


def gumbel_noise(draw_seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise fp32 for token ids `ids` ([V], or [M, k]) of rows with draw seeds `draw_seeds` [M]
    (int64): [M, V] or [M, k], each value a function of (its row's seed, its token id) alone."""
    ids = ids if ids.dim() == 2 else ids[None, :]
    u = _uniform(_splitmix64(draw_seeds[:, None] ^ (ids * _i64(0xD1B54A32D192ED03))))
    return -torch.log(-torch.log(u))


# rows drawn together: bounds the [rows, V] int64 temporaries of a full pass (32 x 152k: 39 MB each)
ROWS_PER_PASS = 32
# below this a temperature samples greedily: the limit it tends to, and logits / T stay finite in fp32
MIN_TEMPERATURE = 1e-5
# top-p's weights in units of 2^-40 of the row's largest: int64 sums, exact in any order (CUDA's scan groups its
# additions by row length), for up to 2^22 tokens a row
TOP_P_SCALE = 2.0 ** 40


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """sample_tokens' ids on the host (the one device->host sync)."""
    return sample_tokens(logits, params, seeds, positions).tolist()


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                  positions: list[int]) -> torch.Tensor:
    """Args: logits [M, V] fp32; per row its params, request seed and output-token index. Returns the M token ids,
    int64 on the logits' device, without a sync (async scheduling feeds them to the next step on the device).

    A row keeps the tokens whose probability is at least min_p times its best one's (0: all), of those its top_k
    best (0: all; ties at the k-th broken by token id), then the smallest prefix of those, best first (ties by token
    id), whose probability reaches top_p (the first always stays); its token is argmax(x + g) over them, the lowest
    id on a tie. Every step is a function of the row alone."""
    greedy = logits.argmax(dim=-1)
    hot = [p.temperature >= MIN_TEMPERATURE for p in params]
    if not any(hot):
        return greedy
    dev, V = logits.device, logits.shape[1]
    ks = [min(p.top_k, V) if h else 1 for p, h in zip(params, hot)]  # a greedy row's draw is thrown away
    # the rows' parameters in two uploads from pinned memory: no sync (a pageable copy may wait for the stream);
    # fp64, so that a top_p as small as SamplingParams takes stays above 0
    floats = to_device([[p.temperature if h else 1.0, p.top_p if h else 1.0, p.min_p if h else 0.0]
                        for p, h in zip(params, hot)], dev, torch.float64)
    ints = to_device([[k, h, _draw_seed(s, pos)] for k, h, s, pos in zip(ks, hot, seeds, positions)], dev)
    drawn = []
    for r0 in range(0, len(params), ROWS_PER_PASS):
        r1 = r0 + ROWS_PER_PASS
        any_min_p = any(p.min_p > 0 and h for p, h in zip(params[r0:r1], hot[r0:r1]))
        rows = _Rows(k=ints[r0:r1, 0], top_p=floats[r0:r1, 1], draw_seeds=ints[r0:r1, 2], kmax=max(ks[r0:r1]),
                     any_top_k=any(ks[r0:r1]), any_top_p=any(p.top_p < 1.0 for p in params[r0:r1]),
                     min_p=floats[r0:r1, 2] if any_min_p else None)
        x = logits[r0:r1].float() / floats[r0:r1, :1].float()
        # every row with a top-k (greedy rows have 1): from each row's kept tokens only, no sort of the vocabulary
        draw = _draw_top_k if all(ks[r0:r1]) else _draw_full
        drawn.append(draw(x, rows))
    # a row whose logits are all -inf (or that holds +inf / NaN) has nothing to draw from: its greedy token
    drawable = ints[:, 1].bool() & torch.isfinite(logits.max(dim=-1).values)
    return torch.where(drawable, torch.cat(drawn), greedy)


@dataclass
class _Rows:
    """Some rows' sampling parameters on the logits' device (k: top-k, 0 off; top_p: 1.0 off; min_p: 0.0 off, None
    where no row has one), and what the host knows of them."""
    k: torch.Tensor
    top_p: torch.Tensor
    draw_seeds: torch.Tensor
    kmax: int
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None


def top_k_mask(x: torch.Tensor, k: torch.Tensor, kmax: int) -> torch.Tensor:
    """[M, V] bool: each row's k best tokens (k [M], at most kmax), exactly k (all where k is 0): those above the
    k-th largest value, then the lowest ids among those equal to it."""
    k = k[:, None]
    kth = torch.topk(x, kmax, dim=-1).values.gather(1, k.clamp(min=1) - 1)  # the k-th value (ties or not)
    above = x > kth
    tied = x == kth
    room = k - above.sum(-1, keepdim=True)                                       # how many tied ones fit
    keep = above | (tied & (tied.cumsum(-1) <= room))
    return keep | (k == 0)


def min_p_keep(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[M, n] bool: the tokens whose probability is at least min_p times the row's most likely one's (tempered
    logits x [M, n] fp32, -inf for dropped ones; min_p [M] fp64, 0.0 keeps all): p / p_max = exp(x - max x), so
    x - max x >= log(min_p), compared in fp64, where the difference of two fp32 values is exact. Commutes with
    top-k (both keep a best-first prefix), so it may come before or after that mask."""
    top = x.max(dim=-1, keepdim=True).values
    return x.double() - top.double() >= torch.log(min_p)[:, None]


def _top_p_drop(sorted_x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Of each row's tempered logits sorted best first (-inf past its kept ones), those past the smallest prefix
    whose probability mass reaches the row's top_p (fp64; the first always stays; rows at 1.0 keep all). The masses
    are unnormalised integers (TOP_P_SCALE) summed in int64: exact, so trailing -inf columns (however many the
    batch gives a row) and the order of the additions change nothing."""
    w = torch.exp((sorted_x - sorted_x[:, :1]).double())  # the row's max first: weights in (0, 1], -inf -> 0
    wi = (w * TOP_P_SCALE).round().long()
    cum = wi.cumsum(-1)
    drop = ((cum - wi).double() >= top_p[:, None] * cum[:, -1:].double()) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    return drop


def top_p_keep(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[M, V] bool: the tokens _top_p_drop keeps of each row (tempered logits x [M, V] fp32, -inf for dropped ones;
    top_p [M] fp64), by sorting the vocabulary, ties by ascending id. (Two histograms of the weights over the fp32
    values' bits in torch ops found the same set and took 1.1-1.4x the sort's time on the H200, BENCHMARKS.md,
    bench_sampling; k3plugins.sample.top_p makes such histograms in Triton: TRITON_TOP_P.)"""
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    return torch.ones_like(x, dtype=torch.bool).scatter(1, order, ~_top_p_drop(sorted_x, top_p))


def best_first(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(vals, ids) [M, n] reordered best first, ties by ascending id: sorted by id, then stably by value."""
    by_id = ids.argsort(dim=-1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    order = vals.sort(dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order)


def _draw_full(x: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """Tokens [M] drawn over the whole vocabulary: argmax(x + Gumbel noise) over each row's kept tokens (Gumbel-max
    needs no normalising: log p differs from x by a constant a row)."""
    if rows.min_p is not None:
        x = x.masked_fill(~min_p_keep(x, rows.min_p), float("-inf"))
    if rows.any_top_k:
        x = x.masked_fill(~top_k_mask(x, rows.k, rows.kmax), float("-inf"))
    if rows.any_top_p:
        if TRITON_TOP_P and x.is_cuda and _triton("top_p_filter") is not None:
            x = _triton("top_p_filter")(x, rows.top_p)
        else:
            x = x.masked_fill(~top_p_keep(x, rows.top_p), float("-inf"))
    return gumbel_argmax(x, rows.draw_seeds)


# The draw as one Triton launch on GPUs (k3plugins.sample): on the H200 0.05 ms against the torch ops' 0.49 at 32
# rows of 163840 tokens, 0.10 against 1.79 at 128, the same tokens (BENCHMARKS.md, bench_sampling)
TRITON_DRAW = True
# Top-p's kept set without a sort, in Triton (k3plugins.sample.top_p): the sort's set bit for bit on an H100 (and in
# the interpreter; compiled for gfx942 too), 0.28-0.29 ms against the sort's 1.24 at 32 rows of 163840 tokens,
# 0.81-0.84 against 4.29 at 128 in the form of the thirty-sixth session's start, about a fifth less since at 128 rows
# (BENCHMARKS.md, bench_sampling)
TRITON_TOP_P = True


def gumbel_argmax(x: torch.Tensor, draw_seeds: torch.Tensor) -> torch.Tensor:
    """argmax(x + gumbel_noise) of each row over the whole vocabulary, the first (lowest id) on a tie: with
    TRITON_DRAW on a CUDA or ROCm GPU one Triton launch (k3plugins.sample), which makes the noise in registers;
    otherwise the torch ops."""
    if TRITON_DRAW and x.is_cuda and _triton("gumbel_argmax") is not None:
        return _triton("gumbel_argmax")(x.contiguous(), draw_seeds)
    ids = torch.arange(x.shape[1], device=x.device)
    return (x + gumbel_noise(draw_seeds, ids)).argmax(dim=-1)


@functools.cache
def _triton(name: str):
    """k3plugins.sample's launch `name` (gumbel_argmax, top_p_filter), or None where Triton does not import (the
    torch ops then)."""
    try:
        from k3plugins.sample import top_p, triton
    except ImportError:
        return None
    return {"gumbel_argmax": triton.gumbel_argmax, "top_p_filter": top_p.top_p_filter}[name]


def _draw_top_k(x: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """_draw_full's tokens for rows that all have a top-k, from the kmax columns that hold each row's kept ones
    (the rest -inf): the same kept sets (min-p's too), the same order for top-p, the same noise a token id and the
    same tie-break, so the same draws, without sorting the vocabulary."""
    vals, ids = torch.topk(x.masked_fill(~top_k_mask(x, rows.k, rows.kmax), float("-inf")), rows.kmax, dim=-1)
    if rows.min_p is not None:  # on the kept ones: min-p commutes with top-k (the row's best is among them)
        vals = vals.masked_fill(~min_p_keep(vals, rows.min_p), float("-inf"))
    if rows.any_top_p:
        vals, ids = best_first(vals, ids)
        vals = vals.masked_fill(_top_p_drop(vals, rows.top_p), float("-inf"))
    by_id = ids.argsort(dim=-1)                                                  # argmax's tie-break: lowest id
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    best = (vals + gumbel_noise(rows.draw_seeds, ids)).argmax(dim=-1)
    return ids.gather(1, best[:, None])[:, 0]
