"""Top-p's kept tokens without sorting the vocabulary, in Triton: the same set as k3runtime.sampler.top_p_keep (which
sorts each row), in eight or nine Triton launches (and a max and a fill of zeros) with no device->host sync.

A token's weight is round(exp(f64(x - max)) · 2^40) as int64, as the sampler's; sorted best first (ties by id) a
token stays while the integer mass before it, as fp64, is below T = top_p · total. That mass only grows, so the kept
tokens are those above one cut value c, then the first ones by id of the tokens at c. c is the fp32 value's
order-keeping key (32 bits), found in three rounds of weight histograms (12, 12 and 8 bits of the key): each round's
histogram (every token of the row that matches the bits found so far, atomic int64 adds, exact in any order) gives the
bucket where the mass above first falls below T. Then the tokens at c are counted a chunk, and a last pass writes x
with every other token at -inf, the tied tokens before each (they all weigh the same) from those counts.

The first round's atomic adds fall on few buckets (a row's logits share few exponents), so it adds into several
copies of its histogram. From LIST_MIN_ROWS rows on, the tokens in the first round's bucket are listed, and the later
rounds read the list, not the rows: their fp64 exp a token was most of their time.

On an H100 at 128 rows of 163840 tokens this takes 0.76 ms a call (wall, its launches included) against 0.98 for
the form before (one histogram a row, the later rounds on the rows) and the sort's 4.3; at 32 rows, where the
launches are most of it, 0.48 against 0.51 (BENCHMARKS.md, bench_sampling). The torch form of these histograms
(scatter-adds into 2^16 buckets) was slower than the sort on the H200, and a pass that bounded the cut from below
cost more than it saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton import row_chunks

# (bits of the key below the round's bucket, buckets) of the three rounds: the key's bits 31-20, 19-8, 7-0
ROUNDS = ((20, 4096), (8, 4096), (0, 256))
BLOCK = 1024
PROGRAMS = 1024  # about this many programs a histogram launch, whatever the rows (as the Triton draw's)
# histograms a row in the first round (top_p_hist_kernel's COPIES): its atomic adds fall on few buckets (a row's
# logits share few exponents), so copies spread them
FIRST_COPIES = 8
# from this many rows the later rounds read a list of the first round's bucket (top_p_list_kernel), not the rows: an
# exp a listed token instead of one a token, for one launch more
LIST_MIN_ROWS = 64


@triton.jit
def _order_key(x):
    """The fp32 values' order as int64 keys in [0, 2^32), +0.0 and -0.0 one key (told by their bits, so that a
    compiler flushing subnormals to zero could not merge those with them)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where((bits & 0x7FFFFFFF) == 0, 0, key).to(tl.int64) + 2147483648


@triton.jit
def _key_value(key):
    """The fp32 value of an order key (_order_key's inverse; the zeros' key gives +0.0)."""
    k = (key - 2147483648).to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _key_weight(x, m):
    """Each token's order key (_order_key) and its top-p weight, round-half-even(exp(f64(x - m)) · 2^40) as int64
    (0 where x - m is NaN: a row whose max m is not finite)."""
    v = tl.exp((x - m).to(tl.float64)) * 1099511627776.0                  # 2^40: sampler.TOP_P_SCALE
    v = (v + 4503599627370496.0) - 4503599627370496.0                      # 2^52: to an integer, half to even
    return _order_key(x), tl.where(v == v, v, 0.0).to(tl.int64)


@triton.jit
def top_p_hist_kernel(x_ptr, m_ptr, state_ptr, hist_ptr, V, stride_x, stride_h, CHUNK, SHIFT: tl.constexpr,
                      NB: tl.constexpr, ABOVE: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr,
                      COPIES: tl.constexpr = 1, LISTED: tl.constexpr = False):
    """hist[row, b] += the weights of the row's tokens (of one chunk) in bucket b: key bits SHIFT and up (NB
    buckets), among those whose bits from ABOVE up match the row's prefix so far (state[row, 0]; FIRST: all).
    COPIES: the row has that many histograms side by side, chunk p adding into copy p % COPIES (the cross kernel
    sums them), so that fewer programs add into one bucket at a time. LISTED: x is top_p_list_kernel's list, its
    first state[row, 2] values (the first round's bucket), not the row."""
    row = tl.program_id(0)
    start = tl.program_id(1) * CHUNK
    m = tl.load(m_ptr + row)
    prefix = tl.load(state_ptr + row * 3)
    if LISTED:
        n = tl.load(state_ptr + row * 3 + 2)
    else:
        n = V
    x_row = x_ptr + row.to(tl.int64) * stride_x
    h_row = hist_ptr + row.to(tl.int64) * stride_h + (tl.program_id(1) % COPIES) * NB
    c0 = 0
    while (c0 < CHUNK) & (start + c0 < n):  # a while loop: a listed row ends at its own count
        ids = start + c0 + tl.arange(0, BLOCK)
        mask = (ids < n) & (c0 + tl.arange(0, BLOCK) < CHUNK)
        x = tl.load(x_row + ids, mask=mask, other=float("-inf"))
        key, w = _key_weight(x, m)
        ok = mask & (w > 0)
        if not FIRST:
            ok = ok & ((key >> ABOVE) == prefix)
        tl.atomic_add(h_row + ((key >> SHIFT) & (NB - 1)), w, mask=ok, sem="relaxed")
        c0 += BLOCK


@triton.jit
def top_p_list_kernel(x_ptr, state_ptr, list_ptr, V, stride_x, stride_l, CHUNK, SHIFT: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Append the chunk's tokens in the first round's bucket (key bits SHIFT and up equal to state[row, 0]) to the
    row's list, counted in state[row, 2] (a block's places taken by one atomic add; the list's order is the
    programs' and does not matter: the later rounds only add weights up). The later rounds then read those, not
    the row, and compute an exp for them alone."""
    row = tl.program_id(0)
    start = tl.program_id(1) * CHUNK
    prefix = tl.load(state_ptr + row * 3)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    l_row = list_ptr + row.to(tl.int64) * stride_l
    for c0 in range(0, CHUNK, BLOCK):
        ids = start + c0 + tl.arange(0, BLOCK)
        mask = (ids < V) & (c0 + tl.arange(0, BLOCK) < CHUNK)
        x = tl.load(x_row + ids, mask=mask, other=float("-inf"))
        hit = mask & ((_order_key(x) >> SHIFT) == prefix)
        taken = tl.sum(hit.to(tl.int32), 0)
        if taken > 0:
            first = tl.atomic_add(state_ptr + row * 3 + 2, taken.to(tl.int64), sem="relaxed")
            tl.store(l_row + first + (tl.cumsum(hit.to(tl.int32), 0) - 1), x, mask=hit)


@triton.jit
def top_p_cross_kernel(hist_ptr, state_ptr, top_p_ptr, t_ptr, stride_h, NB: tl.constexpr, FIRST: tl.constexpr,
                       COPIES: tl.constexpr = 1):
    """The bucket of this round that holds the cut: the lowest whose mass above (the mass above this round's buckets,
    state[row, 1], and the buckets above it) is below T. Its bits are appended to the prefix (state[row, 0]) and the
    mass above it kept (state[row, 1]). FIRST: the round that also finds T = top_p · total (t[row]). COPIES: the
    histogram kernel's copies, summed first."""
    row = tl.program_id(0)
    b = tl.arange(0, NB)
    h_row = hist_ptr + row.to(tl.int64) * stride_h
    h = tl.load(h_row + b)
    for c in tl.static_range(1, COPIES):
        h += tl.load(h_row + c * NB + b)
    level = tl.sum(h, 0)
    if FIRST:
        T = tl.load(top_p_ptr + row) * level.to(tl.float64)
        tl.store(t_ptr + row, T)
        prefix = tl.zeros([], tl.int64)
        above = tl.zeros([], tl.int64)
    else:
        T = tl.load(t_ptr + row)
        prefix = tl.load(state_ptr + row * 3)
        above = tl.load(state_ptr + row * 3 + 1)
    upto = above + level - tl.cumsum(h, 0)                                  # the mass above each bucket
    # below T from some bucket up (the top one's mass above is the rounds' before: below T); the lowest such
    cut = tl.minimum(NB - tl.sum((upto.to(tl.float64) < T).to(tl.int32), 0), NB - 1)
    tl.store(state_ptr + row * 3, prefix * NB + cut)
    tl.store(state_ptr + row * 3 + 1, tl.sum(tl.where(b == cut, upto, 0), 0))


@triton.jit
def _cut(state_ptr, top_p_ptr, row):
    """The row's cut key, or -1 (below every key) for a row that keeps all (top_p >= 1)."""
    return tl.where(tl.load(top_p_ptr + row) >= 1.0, -1, tl.load(state_ptr + row * 3))


@triton.jit
def top_p_ties_kernel(x_ptr, state_ptr, top_p_ptr, ties_ptr, V, stride_x, CHUNK, BLOCK: tl.constexpr):
    """ties[row, part] = how many of the chunk's tokens sit at the row's cut (the mask kernel's count before it)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    c = _cut(state_ptr, top_p_ptr, row)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    n = tl.zeros([], tl.int32)
    for c0 in range(0, CHUNK, BLOCK):
        ids = part * CHUNK + c0 + tl.arange(0, BLOCK)
        mask = (ids < V) & (c0 + tl.arange(0, BLOCK) < CHUNK)
        x = tl.load(x_row + ids, mask=mask, other=float("-inf"))
        n += tl.sum((mask & (_order_key(x) == c)).to(tl.int32), 0)
    tl.store(ties_ptr + row * tl.num_programs(1) + part, n)


@triton.jit
def top_p_mask_kernel(x_ptr, m_ptr, state_ptr, top_p_ptr, t_ptr, ties_ptr, out_ptr, V, stride_x, stride_o, CHUNK,
                      PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """out = x where the row keeps the token, else -inf, a chunk a program: keys above the cut c, and the tokens at c
    whose mass before them (the mass above c, and c's weight for each tied token of lower id: those of earlier
    chunks counted in ties) is below T."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    c = _cut(state_ptr, top_p_ptr, row)
    above = tl.load(state_ptr + row * 3 + 1)
    T = tl.load(t_ptr + row)
    # the tied tokens all hold the cut's value: one weight a row (no exp a token)
    _, w = _key_weight(_key_value(c), tl.load(m_ptr + row))
    earlier = tl.arange(0, PARTS)
    ties = tl.load(ties_ptr + row * tl.num_programs(1) + earlier, mask=earlier < part, other=0)
    tied_before = tl.sum(ties.to(tl.int64), 0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    o_row = out_ptr + row.to(tl.int64) * stride_o
    for c0 in range(0, CHUNK, BLOCK):
        ids = part * CHUNK + c0 + tl.arange(0, BLOCK)
        mask = (ids < V) & (c0 + tl.arange(0, BLOCK) < CHUNK)
        x = tl.load(x_row + ids, mask=mask, other=float("-inf"))
        key = _order_key(x)
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
    parts, chunk = row_chunks(M, V, BLOCK, PROGRAMS)
    copies = [min(FIRST_COPIES, parts)] + [1] * (len(ROUNDS) - 1)  # a copy past the row's chunks would stay zero
    hist = torch.zeros(M, sum(nb * n for (_, nb), n in zip(ROUNDS, copies)), dtype=torch.int64, device=x.device)
    state = torch.zeros(M, 3, dtype=torch.int64, device=x.device)  # prefix, mass above it, listed tokens
    T = torch.empty(M, dtype=torch.float64, device=x.device)
    out = torch.empty_like(x)  # the list of the first round's bucket until the mask kernel writes it
    offset = 0
    listed = M >= LIST_MIN_ROWS
    for i, ((shift, nb), n) in enumerate(zip(ROUNDS, copies)):
        h = hist[:, offset:offset + nb * n]
        src = out if listed and i > 0 else x
        top_p_hist_kernel[(M, parts)](src, row_max, state, h, V, src.stride(0), hist.stride(0), chunk, SHIFT=shift,
                                      NB=nb, ABOVE=shift + nb.bit_length() - 1, FIRST=i == 0, BLOCK=BLOCK,
                                      COPIES=n, LISTED=listed and i > 0, num_warps=4)
        top_p_cross_kernel[(M,)](h, state, top_p, T, hist.stride(0), NB=nb, FIRST=i == 0, COPIES=n, num_warps=4)
        if listed and i == 0:
            top_p_list_kernel[(M, parts)](x, state, out, V, x.stride(0), out.stride(0), chunk, SHIFT=shift,
                                          BLOCK=BLOCK, num_warps=4)
        offset += nb * n
    ties = torch.empty(M, parts, dtype=torch.int32, device=x.device)
    top_p_ties_kernel[(M, parts)](x, state, top_p, ties, V, x.stride(0), chunk, BLOCK=BLOCK, num_warps=4)
    top_p_mask_kernel[(M, parts)](x, row_max, state, top_p, T, ties, out, V, x.stride(0), out.stride(0), chunk,
                                  PARTS=triton.next_power_of_2(parts), BLOCK=BLOCK, num_warps=4)
    return out
