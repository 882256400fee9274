"""Top-p's kept tokens without sorting the vocabulary, in Triton: the same set as k3runtime.sampler.top_p_keep (which
sorts each row), in eight launches with no device->host sync.

A token's weight is round(exp(f64(x - max)) · 2^40) as int64, as the sampler's; sorted best first (ties by id) a
token stays while the integer mass before it, as fp64, is below T = top_p · total. That mass only grows, so the kept
tokens are those above one cut value c, then the first ones by id of the tokens at c. c is the fp32 value's
order-keeping key (32 bits), found in three rounds of weight histograms (12, 12 and 8 bits of the key): each round's
histogram (every token of the row that matches the bits found so far, atomic int64 adds, exact in any order) gives the
bucket where the mass above first falls below T. A last pass writes x with every other token at -inf, counting the
tied tokens at c by id as it goes (they all weigh the same).

On the H200 the sort took 1.1 ms at 32 rows of 163840 tokens (BENCHMARKS.md, bench_sampling); the torch form of
these histograms (scatter-adds into 2^16 buckets) was slower than the sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (bits of the key below the round's bucket, buckets) of the three rounds: the key's bits 31-20, 19-8, 7-0
ROUNDS = ((20, 4096), (8, 4096), (0, 256))
BLOCK = 1024
PROGRAMS = 1024  # about this many programs a histogram launch, whatever the rows (as the Triton draw's)


@triton.jit
def _key_weight(x, m):
    """Each token's order key (int64 in [0, 2^32): as the fp32 values, +0.0 and -0.0 one key) and its top-p weight,
    round-half-even(exp(f64(x - m)) · 2^40) as int64 (0 where x - m is NaN: a row whose max m is not finite)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    v = tl.exp((x - m).to(tl.float64)) * 1099511627776.0                  # 2^40: sampler.TOP_P_SCALE
    v = (v + 4503599627370496.0) - 4503599627370496.0                      # 2^52: to an integer, half to even
    return key.to(tl.int64) + 2147483648, tl.where(v == v, v, 0.0).to(tl.int64)


@triton.jit
def top_p_hist_kernel(x_ptr, m_ptr, state_ptr, hist_ptr, V, stride_x, stride_h, CHUNK, SHIFT: tl.constexpr,
                      NB: tl.constexpr, ABOVE: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """hist[row, b] += the weights of the row's tokens (of one chunk) in bucket b: key bits SHIFT and up (NB
    buckets), among those whose bits from ABOVE up match the row's prefix so far (state[row, 0]; FIRST: all)."""
    row = tl.program_id(0)
    start = tl.program_id(1) * CHUNK
    m = tl.load(m_ptr + row)
    prefix = tl.load(state_ptr + row * 2)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    h_row = hist_ptr + row.to(tl.int64) * stride_h
    for c0 in range(0, CHUNK, BLOCK):
        ids = start + c0 + tl.arange(0, BLOCK)
        mask = (ids < V) & (c0 + tl.arange(0, BLOCK) < CHUNK)
        x = tl.load(x_row + ids, mask=mask, other=float("-inf"))
        key, w = _key_weight(x, m)
        ok = mask & (w > 0)
        if not FIRST:
            ok = ok & ((key >> ABOVE) == prefix)
        tl.atomic_add(h_row + ((key >> SHIFT) & (NB - 1)), w, mask=ok, sem="relaxed")


@triton.jit
def top_p_cross_kernel(hist_ptr, state_ptr, top_p_ptr, t_ptr, stride_h, NB: tl.constexpr, FIRST: tl.constexpr):
    """The bucket of this round where the row's mass above (state[row, 1], and the buckets above it) first falls below
    T: its bits appended to the prefix (state[row, 0]) and the mass above it kept (state[row, 1]). FIRST: the
    round that also finds T = top_p · total (t[row])."""
    row = tl.program_id(0)
    b = tl.arange(0, NB)
    h = tl.load(hist_ptr + row.to(tl.int64) * stride_h + b)
    level = tl.sum(h, 0)
    if FIRST:
        T = tl.load(top_p_ptr + row) * level.to(tl.float64)
        tl.store(t_ptr + row, T)
        prefix = tl.zeros([], tl.int64)
        above = tl.zeros([], tl.int64)
    else:
        T = tl.load(t_ptr + row)
        prefix = tl.load(state_ptr + row * 2)
        above = tl.load(state_ptr + row * 2 + 1)
    upto = above + level - tl.cumsum(h, 0)                                  # the mass above each bucket
    # below T from some bucket up (the top one's mass above is the rounds' before: below T); the lowest such
    cut = tl.minimum(NB - tl.sum((upto.to(tl.float64) < T).to(tl.int32), 0), NB - 1)
    tl.store(state_ptr + row * 2, prefix * NB + cut)
    tl.store(state_ptr + row * 2 + 1, tl.sum(tl.where(b == cut, upto, 0), 0))


@triton.jit
def top_p_mask_kernel(x_ptr, m_ptr, state_ptr, top_p_ptr, t_ptr, out_ptr, V, stride_x, stride_o,
                      BLOCK: tl.constexpr):
    """out = x where the row keeps the token, else -inf: keys above the cut c (state[row, 0]), and the tokens at c
    whose mass before them (the mass above c and the tied ones of lower id, all of c's weight) is below T. A row
    with top_p >= 1 keeps all."""
    row = tl.program_id(0)
    # a row that keeps all: a cut below every key (keys are >= 0)
    c = tl.where(tl.load(top_p_ptr + row) >= 1.0, -1, tl.load(state_ptr + row * 2))
    above = tl.load(state_ptr + row * 2 + 1)
    T = tl.load(t_ptr + row)
    m = tl.load(m_ptr + row)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    o_row = out_ptr + row.to(tl.int64) * stride_o
    tied_before = tl.zeros([], tl.int64)
    for v0 in range(0, V, BLOCK):
        ids = v0 + tl.arange(0, BLOCK)
        mask = ids < V
        x = tl.load(x_row + ids, mask=mask, other=float("-inf"))
        key, w = _key_weight(x, m)
        tied = (mask & (key == c)).to(tl.int64)
        before = above + (tied_before + tl.cumsum(tied, 0) - tied) * w
        keep = (key > c) | ((tied > 0) & (before.to(tl.float64) < T))
        tl.store(o_row + ids, tl.where(keep, x, float("-inf")), mask=mask)
        tied_before += tl.sum(tied, 0)


def top_p_filter(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [M, V] fp32 (tempered logits, -inf for tokens already dropped; last dim contiguous) with each row's tokens
    outside its top-p set at -inf (top_p [M] fp64, any stride; 1.0 keeps all): x.masked_fill(~top_p_keep(x, top_p),
    -inf) of k3runtime.sampler, on x's device with no sync."""
    M, V = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"top_p_filter: x must be fp32 with a contiguous last dim, got {x.dtype} {tuple(x.stride())}")
    top_p = top_p.to(torch.float64).contiguous()
    row_max = x.max(dim=1).values
    hist = torch.zeros(M, sum(nb for _, nb in ROUNDS), dtype=torch.int64, device=x.device)
    state = torch.zeros(M, 2, dtype=torch.int64, device=x.device)
    T = torch.empty(M, dtype=torch.float64, device=x.device)
    parts = max(1, min(triton.cdiv(V, BLOCK), PROGRAMS // max(M, 1)))
    chunk = triton.cdiv(triton.cdiv(V, parts), BLOCK) * BLOCK
    parts = triton.cdiv(V, chunk)
    offset = 0
    for i, (shift, nb) in enumerate(ROUNDS):
        h = hist[:, offset:offset + nb]
        top_p_hist_kernel[(M, parts)](x, row_max, state, h, V, x.stride(0), hist.stride(0), chunk, SHIFT=shift,
                                      NB=nb, ABOVE=shift + nb.bit_length() - 1, FIRST=i == 0, BLOCK=BLOCK,
                                      num_warps=4)
        top_p_cross_kernel[(M,)](h, state, top_p, T, hist.stride(0), NB=nb, FIRST=i == 0, num_warps=4)
        offset += nb
    out = torch.empty_like(x)
    top_p_mask_kernel[(M,)](x, row_max, state, top_p, T, out, V, x.stride(0), out.stride(0), BLOCK=BLOCK,
                            num_warps=4)
    return out
