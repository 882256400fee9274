"""MLA prefill in the un-absorbed (MHA) form: the cached latents up-projected to per-head keys and values once a
step, then causal flash attention over them.

Why: the absorbed form (the decode kernel, each prompt token a query row) costs 2·(576 + 512) = 2176 FLOPs a
query-key pair a head, as every pair multiplies the whole 576-wide latent. Up-projected, a pair costs
2·(192 + 128) = 640, plus the up-projection itself, 2·512·(128 + 128) FLOPs a key a head, paid once for all the
step's queries of that sequence. So a sequence with more than about 170 new tokens in a step is cheaper this way
(2048 new tokens after 8192 cached: about 2.8x less math); decode stays absorbed. DeepSeek's and vLLM's MLA split
prefill from decode the same way.

The keys and values of a long context do not fit at once (96 heads: 48 KiB a token, bf16), so the context is taken
in pieces of at most KEY_PIECE_BYTES; each piece's attention is merged into the running output by log-sum-exp, in
the kernel. Every index the mixer needs comes from the host's lengths (the scheduler's, `host_seqs`): the piece
loop and the grids are host values, and no device value is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3plugins.pdl import pdl, pdl_prologue
from k3plugins.sm_count import sm_count
from k3plugins.step_scope import per_step

# a sequence with at least this many new tokens in a step takes the MHA form. On an H100 (BENCHMARKS.md, the
# mla_prefill rows, fiftieth session) against the best absorbed kernel at 96 heads: 256 new tokens after 2048 cached
# 1.26x faster; 192 after 2048 or 8192 0.97x / 0.91x; 128 0.87x. So the break-even lies between 192 and 256 there
# (the FLOPs say about 170)
MIN_NEW_TOKENS = 256
# with fewer heads a lower threshold (the least of it and MIN_NEW_TOKENS): (heads at most, new tokens at least). The
# absorbed kernels compute a block of 64 heads whatever the count, so at few heads the MHA form wins earlier. On an
# H100 (fifty-second session), MHA against the best absorbed after 2048 or 8192 cached: 6 and 16 heads, 128 new
# tokens 1.04-1.29x faster, 64 0.68-0.77x; 32 and 48 heads, 192 new tokens 1.16-1.56x faster (128 not measured).
# Only for contexts of FEW_HEADS_MIN_CONTEXT tokens or more, those measured: over a short context the absorbed
# kernel's rows cost little, while the MHA form pays its launches and up-projection whatever the context
FEW_HEADS_MIN_NEW_TOKENS = ((16, 128), (64, 192))
FEW_HEADS_MIN_CONTEXT = 2048
# the up-projected keys and values of one piece of a context at most (96 heads: about 5.4K tokens a piece)
KEY_PIECE_BYTES = 256 << 20
# the keys that every query row of a block sees attended first, without the causal mask: 3.77 -> 3.28 ms at 2048
# after 8192 (H100)
SPLIT_DIAGONAL = True
# several sequences of a step in one launch where their contexts fit a piece together (attend_sequences). On an H100
# (BENCHMARKS.md, fifty-third session) against one launch a sequence, from CUDA graphs: 1.1-13x faster where 2 to 32
# sequences share a launch (the least at 96 heads after 2048 cached, a piece holding two to four contexts), level
# where each is alone (0.97-1.02x)
SHARED_LAUNCH = True
# with SHARED_LAUNCH, sequences together: the step's sequences with TOGETHER_MIN_NEW_TOKENS new tokens or more and,
# above TOGETHER_ANY_CONTEXT_HEADS heads, a context at most TOGETHER_CONTEXT_PER_NEW times them (fresh prompts: few
# keys to up-project a query) all take the MHA form when there are TOGETHER_LEAST[0] of them or more with
# TOGETHER_LEAST[1] new tokens or more between them. On an H100 (BENCHMARKS.md, fifty-third session) against the
# absorbed kernel on the same rows, from CUDA graphs, every measured row these limits take was 1.29-10.7x faster
# (4 to 32 sequences of 64 to 512 new tokens, 6 to 96 heads); those they leave out that no other threshold takes
# were 0.48-1.17x (two prompts of 192 fresh tokens at 96 heads: 1.54x), e.g. at 96 heads 8 x 64 new tokens after
# 1024 cached 0.58x, 16 x 64 after 2048 0.48x. Beside 32-128 decode rows of 2K-8K tokens in the step (fifty-fourth
# session), whose absorbed pass is paid either way: 1.05-3.0x for 4 x 128, 8 x 64 and 32 x 128 at 6 and 96 heads
TOGETHER_MIN_NEW_TOKENS = 64
TOGETHER_ANY_CONTEXT_HEADS = 16
TOGETHER_CONTEXT_PER_NEW = 8
TOGETHER_LEAST = (4, 512)
# query rows and warps a program: 128 in 8 warps, or 64 in 4 where 128-row blocks would leave half the SMs or more
# idle. On an H100 (BENCHMARKS.md, fifty-first session), 64-row blocks took 0.80-0.83x the time where the 128-row
# grid was 12-64 programs (6 or 16 heads, 256 or 512 new tokens after 2048), 0.98x at 96 programs with 2K cached
# keys but 1.19x with 8K, 1.06-1.40x at 96 heads
BLOCK_M, NUM_WARPS = 128, 8
SMALL_GRID_BLOCK_M, SMALL_GRID_NUM_WARPS = 64, 4


@triton.jit
def _attend(acc, l_i, m_i, q, qp, k_ptr, kpe_ptr, v_ptr, h, begin, end, n_end, q_pos, k_pos0, qk_scale, stride_kt,
            stride_kh, stride_pt, stride_vt, stride_vh, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
            BDN: tl.constexpr, BDR: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr):
    """The online softmax over keys begin ... end - 1 of the piece (MASKED: each row only up to its own position,
    and keys from n_end on not at all)."""
    rn = tl.arange(0, BDN)
    rr = tl.arange(0, BDR)
    rv = tl.arange(0, BDV)
    for start in range(begin, end, BN):
        cols = start + tl.arange(0, BN)
        c_ok = cols < n_end
        k = tl.load(k_ptr + cols[:, None].to(tl.int64) * stride_kt + h * stride_kh + rn[None, :],
                    mask=c_ok[:, None] & (rn < DN)[None, :], other=0.0)                                # [BN, BDN]
        s = tl.dot(q, tl.trans(k))
        if DR > 0:
            kp = tl.load(kpe_ptr + cols[:, None].to(tl.int64) * stride_pt + rr[None, :],
                         mask=c_ok[:, None] & (rr < DR)[None, :], other=0.0)                           # [BN, BDR]
            if BDR >= 16:
                s += tl.dot(qp, tl.trans(kp))
            else:  # an MMA needs K >= 16: small test models' rope parts are summed directly
                s += tl.sum(qp[:, None, :].to(tl.float32) * kp[None, :, :].to(tl.float32), 2)
        if MASKED:
            seen = c_ok[None, :] & ((k_pos0 + cols)[None, :] <= q_pos[:, None])
            s = tl.where(seen, s * qk_scale, float("-inf"))
        else:
            s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet: no NaN from -inf - -inf
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + cols[:, None].to(tl.int64) * stride_vt + h * stride_vh + rv[None, :],
                    mask=c_ok[:, None] & (rv < DV)[None, :], other=0.0)                                # [BN, BDV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def mha_prefill_kernel(q_ptr, k_ptr, kpe_ptr, v_ptr, o_ptr, prev_ptr, lse_ptr, T, q_pos0, k_pos0, P, sm_scale,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_vt, stride_vh, stride_ot,
                       stride_oh, stride_prt, stride_prh, stride_lt, DN: tl.constexpr, DR: tl.constexpr,
                       DV: tl.constexpr, BDN: tl.constexpr, BDR: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, HAS_PREV: tl.constexpr, SPLIT: tl.constexpr = False,
                       PDL: tl.constexpr = False, blocks_ptr=None, VARLEN: tl.constexpr = False):
    """One head and BM query rows of one sequence (absolute positions q_pos0 + row) against keys
    k_pos0 ... k_pos0 + P - 1 of it, causal. q: [T, H, DN + DR] (nope | pe); k: [P, H, DN]; kpe: [P, DR], one for
    every head; v: [P, H, DV]. o [T, H, DV] (any float dtype) and lse [T, H] fp32 (log2 units): written, or with
    HAS_PREV merged with what an earlier piece of the same context left in prev [T, H, DV] fp32 and lse (prev may be
    o itself).
    VARLEN: several sequences, each whole context one piece (T, q_pos0, k_pos0 and P unused): the grid's second
    dimension runs over blocks_ptr's rows, int32 [blocks, 5] (the block's sequence's first row in q / o / lse, its
    new tokens, its context length, its first key in k / kpe / v, the block's index in the sequence)."""
    pdl_prologue(PDL)
    # every head's last rows (the most keys) start first: heads are the grid's fastest dimension, rows reversed
    h = tl.program_id(0).to(tl.int64)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    if VARLEN:  # the host ordered the blocks, most keys first
        block = blocks_ptr + tl.program_id(1) * 5
        q_start, T, P, k_start, pid_m = (tl.load(block).to(tl.int64), tl.load(block + 1), tl.load(block + 2),
                                         tl.load(block + 3).to(tl.int64), tl.load(block + 4))
        q_pos0, k_pos0 = P - T, 0
        q_ptr += q_start * stride_qt
        o_ptr += q_start * stride_ot
        lse_ptr += q_start * stride_lt
        k_ptr += k_start * stride_kt
        kpe_ptr += k_start * stride_pt
        v_ptr += k_start * stride_vt
    rows = pid_m * BM + tl.arange(0, BM)
    r_ok = rows < T
    q_pos = q_pos0 + rows
    rn = tl.arange(0, BDN)
    rr = tl.arange(0, BDR)
    rv = tl.arange(0, BDV)
    q_row = q_ptr + rows[:, None].to(tl.int64) * stride_qt + h * stride_qh
    q = tl.load(q_row + rn[None, :], mask=r_ok[:, None] & (rn < DN)[None, :], other=0.0)             # [BM, BDN]
    qp = q  # unused without a rope part
    if DR > 0:
        qp = tl.load(q_row + DN + rr[None, :], mask=r_ok[:, None] & (rr < DR)[None, :], other=0.0)   # [BM, BDR]
    qk_scale = sm_scale * 1.4426950408889634  # exp2 in the loop
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BDV), dtype=tl.float32)
    # causal: this block's last row sees keys up to its own position, so later keys of the piece are not read;
    # with SPLIT, the keys every row of the block sees (up to its first row's position) go first, unmasked
    last_pos = q_pos0 + tl.minimum((pid_m + 1) * BM, T) - 1
    n_end = tl.minimum(P, last_pos - k_pos0 + 1)
    n_open = 0
    if SPLIT:
        n_open = tl.maximum(tl.minimum(P, q_pos0 + pid_m * BM - k_pos0 + 1), 0) // BN * BN
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, qp, k_ptr, kpe_ptr, v_ptr, h, 0, n_open, n_end, q_pos, k_pos0,
                                qk_scale, stride_kt, stride_kh, stride_pt, stride_vt, stride_vh, DN, DR, DV, BDN, BDR,
                                BDV, BN, MASKED=False)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, qp, k_ptr, kpe_ptr, v_ptr, h, n_open, n_end, n_end, q_pos, k_pos0,
                            qk_scale, stride_kt, stride_kh, stride_pt, stride_vt, stride_vh, DN, DR, DV, BDN, BDR, BDV,
                            BN, MASKED=True)
    # a row that saw no key of this piece (its position before the piece) has l_i = 0: weight 0 in the merge
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
    lse_at = lse_ptr + rows.to(tl.int64) * stride_lt + h
    o_mask = r_ok[:, None] & (rv < DV)[None, :]
    if HAS_PREV:
        lse_prev = tl.load(lse_at, mask=r_ok, other=float("-inf"))
        o_prev = tl.load(prev_ptr + rows[:, None].to(tl.int64) * stride_prt + h * stride_prh + rv[None, :],
                         mask=o_mask, other=0.0)
        m = tl.maximum(lse_prev, lse)
        m = tl.where(m == float("-inf"), 0.0, m)
        w_prev = tl.exp2(lse_prev - m)
        w_new = tl.exp2(lse - m)
        total = w_prev + w_new
        safe_t = tl.where(total > 0, total, 1.0)
        o = (o_prev * w_prev[:, None] + o * w_new[:, None]) / safe_t[:, None]
        lse = tl.where(total > 0, m + tl.log2(safe_t), float("-inf"))
    tl.store(o_ptr + rows[:, None].to(tl.int64) * stride_ot + h * stride_oh + rv[None, :], o, mask=o_mask)
    tl.store(lse_at, lse, mask=r_ok)


def _block(n: int) -> int:
    """A power-of-two width for a head dim, at least 16 (an MMA's K)."""
    return max(16, triton.next_power_of_2(n))


def _rope_block(n: int) -> int:
    """The rope part's width: an MMA's from 16 up; below, the kernel sums its products directly (1 for none)."""
    return _block(n) if n >= 16 else triton.next_power_of_2(max(n, 1))


def query_block(num_heads: int, num_rows: int, num_sms: int) -> tuple[int, int]:
    """(query rows, warps) of a program for num_rows new tokens of num_heads heads on num_sms SMs (0: unknown)."""
    if 2 * num_heads * triton.cdiv(num_rows, BLOCK_M) <= num_sms:
        return SMALL_GRID_BLOCK_M, SMALL_GRID_NUM_WARPS
    return BLOCK_M, NUM_WARPS


def key_piece(num_heads: int, nope: int, v_head_dim: int, itemsize: int) -> int:
    """Keys a piece: as many whole pages as KEY_PIECE_BYTES holds of up-projected keys and values (one page at
    least)."""
    per_key = num_heads * (nope + v_head_dim) * itemsize
    return max(64, KEY_PIECE_BYTES // per_key // 64 * 64)


def _up_weights(w_uk: torch.Tensor, w_uv: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[r, H·nope] and [r, H·v] in `dtype`: one GEMM each for every head's keys / values (the w_uv copy is r·H·v
    elements a layer, small beside the GEMMs)."""
    H, nope, r = w_uk.shape
    return w_uk.to(dtype).reshape(H * nope, r).t(), w_uv.to(dtype).transpose(0, 1).reshape(r, H * w_uv.shape[2])


def _keys_values(rows: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                 H: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cache rows [P, r + rope] up-projected: keys [P, H, nope], values [P, H, v], and their rope part [P, rope]
    (one for every head)."""
    r = w_k.shape[0]
    latent = rows[:, :r]
    return (latent @ w_k).view(-1, H, w_k.shape[1] // H), (latent @ w_v).view(-1, H, w_v.shape[1] // H), rows[:, r:]


def mha_prefill(q: torch.Tensor, kv_cache: torch.Tensor, page_row: torch.Tensor, context_len: int,
                w_uk: torch.Tensor, w_uv: torch.Tensor, *, scale: float, out: torch.Tensor,
                block_m: int | None = None, block_n: int = 64, num_warps: int | None = None, num_stages: int = 3,
                split: bool | None = None) -> None:
    """Causal attention of one sequence's T new tokens (its last T positions) over its whole cached context, in
    the un-absorbed form, into `out`.

    Args:
        q: [T, H, nope + rope] the tokens' queries (q_b's output, nope | pe).
        kv_cache: [num_pages, page, r + rope] this layer's cache, the step's own tokens already written.
        page_row: [max_pages] this sequence's page-table row (device). context_len: its tokens (host).
        w_uk: [H, nope, r]; w_uv: [H, r, v].
        out: [T, H, v] written (any float dtype; a row stride and a head stride, unit columns).
        block_m, block_n, num_warps, num_stages, split: the kernel's tactic (block_m and num_warps both None:
            query_block's; split: SPLIT_DIAGONAL if None).
    """
    T, H, _ = q.shape
    _, nope, r = w_uk.shape
    vd = w_uv.shape[2]
    page, width = kv_cache.shape[1], kv_cache.shape[2]
    rope = width - r
    dtype = kv_cache.dtype
    if q.shape[2] != nope + rope or T > context_len:
        raise ValueError(f"mha_prefill: q must be [T <= {context_len}, {H}, {nope + rope}], got {tuple(q.shape)}")
    w_k, w_v = _up_weights(w_uk, w_uv, dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if out.stride(-1) != 1:
        raise ValueError("mha_prefill: out needs unit column strides")
    piece = key_piece(H, nope, vd, kv_cache.element_size())
    # the pieces before the last merge into an fp32 running output; the last (or only) piece writes `out` itself
    acc = torch.empty(T, H, vd, dtype=torch.float32, device=q.device) if context_len > piece else out
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    q_pos0 = context_len - T
    if block_m is None and num_warps is None:
        block_m, num_warps = query_block(H, T, sm_count(q.device))
    bm = min(block_m or BLOCK_M, max(16, triton.next_power_of_2(T)))
    for k0 in range(0, context_len, piece):
        k1 = min(context_len, k0 + piece)
        p0 = k0 // page
        rows = kv_cache.index_select(0, page_row[p0:triton.cdiv(k1, page)].long()).view(-1, width)
        rows = rows[k0 - p0 * page:k1 - p0 * page]                                        # [P, r + rope]
        k, v, kpe = _keys_values(rows, w_k, w_v, H)
        o = out if k1 == context_len else acc
        mha_prefill_kernel[(H, triton.cdiv(T, bm))](
            q, k, kpe, v, o, acc, lse, T, q_pos0, k0, k1 - k0, float(scale), q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), kpe.stride(0), v.stride(0), v.stride(1), o.stride(0), o.stride(1), acc.stride(0),
            acc.stride(1), lse.stride(0),
            DN=nope, DR=rope, DV=vd, BDN=_block(nope), BDR=_rope_block(rope), BDV=_block(vd), BM=bm, BN=block_n,
            HAS_PREV=k0 > 0, SPLIT=SPLIT_DIAGONAL if split is None else split, num_warps=num_warps or NUM_WARPS,
            num_stages=num_stages, **pdl(q))


def attend_sequences(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                     picked: list[tuple[int, int, int, int]], w_uk: torch.Tensor, w_uv: torch.Tensor, *,
                     scale: float, out: torch.Tensor) -> None:
    """Every picked sequence (sequences()'s list) attended in the MHA form into its rows of `out`: with
    SHARED_LAUNCH, consecutive sequences whose whole contexts fit one piece together share a launch
    (mha_prefill_varlen: one gather, one up-projection GEMM each for keys and values, one kernel); a sequence alone
    or whose context takes several pieces (every sequence without SHARED_LAUNCH) runs mha_prefill.
    q: [T, H, nope + rope] the step's queries; page_table: [B, max_pages]."""
    H, nope, vd = q.shape[1], w_uk.shape[1], w_uv.shape[2]
    page = kv_cache.shape[1]
    q = q.to(kv_cache.dtype)
    piece = key_piece(H, nope, vd, kv_cache.element_size()) if SHARED_LAUNCH else 0
    for group in launch_groups(picked, page, piece):
        if len(group) == 1:
            n, start, end, context = group[0]
            mha_prefill(q[start:end], kv_cache, page_table[n], context, w_uk, w_uv, scale=scale, out=out[start:end])
        else:
            mha_prefill_varlen(q, kv_cache, page_table, group, w_uk, w_uv, scale=scale, out=out)


def launch_groups(picked: list[tuple[int, int, int, int]], page: int,
                  piece: int) -> list[list[tuple[int, int, int, int]]]:
    """The picked sequences, in order, cut into launches: as many consecutive ones as have their contexts' whole
    pages within `piece` keys together; a context over a piece alone (mha_prefill takes it in pieces)."""
    groups, keys = [], piece + 1  # keys of the open group (over a piece: none open)
    for seq in picked:
        need = triton.cdiv(seq[3], page) * page
        if keys + need <= piece:
            groups[-1].append(seq)
            keys += need
        else:
            groups.append([seq])
            keys = need  # a context over a piece leaves its group closed
    return groups


def _varlen_layout(group: list[tuple[int, int, int, int]], page_table: torch.Tensor, page: int, bm: int):
    """(the group's pages in the order their keys are laid out, int64 on the device; its blocks, int32 [blocks, 5]
    on the device, most keys first). From the host's lengths: device slices and one copy from page-locked memory,
    no sync."""
    pages, blocks, k_start = [], [], 0
    for n, start, end, context in group:
        used = triton.cdiv(context, page)
        pages.append(page_table[n, :used])
        new = end - start
        for m in range(triton.cdiv(new, bm)):
            seen = context - new + min((m + 1) * bm, new)  # keys the block's last row sees
            blocks.append((seen, (start, new, context, k_start, m)))
        k_start += used * page
    blocks.sort(key=lambda b: -b[0])
    table = torch.tensor([b[1] for b in blocks], dtype=torch.int32)
    if page_table.is_cuda:
        table = table.pin_memory().to(page_table.device, non_blocking=True)
    return torch.cat(pages).long(), table


def mha_prefill_varlen(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                       group: list[tuple[int, int, int, int]], w_uk: torch.Tensor, w_uv: torch.Tensor, *,
                       scale: float, out: torch.Tensor, block_n: int = 64, num_stages: int = 3) -> None:
    """mha_prefill for several sequences at once (group: sequences()'s tuples), each whole context in one piece
    (launch_groups'): the contexts' pages gathered and up-projected together, one kernel over all their query
    blocks. q: [T, H, nope + rope] the step's queries in the cache's dtype; out: [T, H, v] (the group's rows
    written). The layout is made once a step (per_step) for the MLA layers that follow."""
    T, H, _ = q.shape
    _, nope, r = w_uk.shape
    vd = w_uv.shape[2]
    page, width = kv_cache.shape[1], kv_cache.shape[2]
    rope = width - r
    if out.stride(-1) != 1:
        raise ValueError("mha_prefill_varlen: out needs unit column strides")
    rows_new = sum(end - start for _, start, end, _ in group)
    block_m, num_warps = query_block(H, rows_new, sm_count(q.device))
    bm = min(block_m, max(16, triton.next_power_of_2(max(end - start for _, start, end, _ in group))))
    pages, blocks = per_step(f"mla_varlen:{group[0][0]}:{bm}", (page_table,),
                             lambda pt: _varlen_layout(group, pt, page, bm))
    rows = kv_cache.index_select(0, pages).view(-1, width)                                   # [keys, r + rope]
    k, v, kpe = _keys_values(rows, *_up_weights(w_uk, w_uv, kv_cache.dtype), H)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    mha_prefill_kernel[(H, blocks.shape[0])](
        q, k, kpe, v, out, out, lse, T, 0, 0, 0, float(scale), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        kpe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), DN=nope, DR=rope, DV=vd, BDN=_block(nope), BDR=_rope_block(rope), BDV=_block(vd), BM=bm,
        BN=block_n, HAS_PREV=False, SPLIT=SPLIT_DIAGONAL, num_warps=num_warps, num_stages=num_stages,
        blocks_ptr=blocks, VARLEN=True, **pdl(q))


def min_new_tokens(num_heads: int, context: int) -> int:
    """New tokens a sequence with `context` tokens (its new ones included) needs in a step to take the MHA form,
    at num_heads heads."""
    lower = [tokens for heads, tokens in FEW_HEADS_MIN_NEW_TOKENS if num_heads <= heads]
    if context < FEW_HEADS_MIN_CONTEXT:
        lower = []
    return min([MIN_NEW_TOKENS, *lower[:1]])


def sequences(host_seqs: tuple[tuple[int, int], ...] | None, cu_seqlens: torch.Tensor, T: int,
              num_heads: int) -> list[tuple[int, int, int, int]]:
    """(sequence, first row, end row, context length) of each sequence of the step that takes the MHA form: those
    with min_new_tokens(num_heads, context) new tokens or more, and with SHARED_LAUNCH those that join the MHA
    form together (TOGETHER_LEAST), as the host's lengths say (none without them)."""
    if host_seqs is None:
        return []
    if len(host_seqs) != cu_seqlens.shape[0] - 1 or sum(new for new, _ in host_seqs) != T:
        raise ValueError(f"mla_mixer: host_seqs gives {len(host_seqs)} sequences of "
                         f"{sum(new for new, _ in host_seqs)} new tokens; the step has {cu_seqlens.shape[0] - 1} of "
                         f"{T}")
    for n, (new, context) in enumerate(host_seqs):
        if new > context:
            raise ValueError(f"mla_mixer: host_seqs[{n}] has {new} new tokens in a context of {context}")
    joins = [new >= TOGETHER_MIN_NEW_TOKENS
             and (num_heads <= TOGETHER_ANY_CONTEXT_HEADS or context <= TOGETHER_CONTEXT_PER_NEW * new)
             for new, context in host_seqs]
    together = (SHARED_LAUNCH and sum(joins) >= TOGETHER_LEAST[0]
                and sum(new for (new, _), j in zip(host_seqs, joins) if j) >= TOGETHER_LEAST[1])
    picked, start = [], 0
    for n, (new, context) in enumerate(host_seqs):
        if new >= min_new_tokens(num_heads, context) or (together and joins[n]):
            picked.append((n, start, start + new, context))
        start += new
    return picked


def other_rows(picked: list[tuple[int, int, int, int]], T: int, device: torch.device) -> torch.Tensor | None:
    """The step's rows outside the picked sequences (those the absorbed kernel attends), int64 on `device`, or None
    if there are none. Made by aranges of host bounds: `torch.tensor(rows, device=...)` would copy from pageable
    memory and then wait for the stream, that is for every layer launched before it (a host sync a layer)."""
    bounds, done = [], 0
    for _, start, end, _ in picked:  # in row order
        bounds.append((done, start))
        done = end
    bounds.append((done, T))
    ranges = [torch.arange(a, b, dtype=torch.int64, device=device) for a, b in bounds if b > a]
    return torch.cat(ranges) if ranges else None
