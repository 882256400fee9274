"""Absorbed-MLA paged decode for Hopper (sm_90) in Gluon: the 64-head-block path of `mla_decode_attention`,
with the same split-K partials and merge as the portable Triton kernel (triton.py).

Why a second kernel: Triton's kernel issues the next page's copy only after this page's math (two stages hold all
its 72 KB pages beside 72 KB of queries), so load and math barely overlap, and its chained dots put both
warpgroups on the same 64 scores unless they go through an L2 scratch (BENCHMARKS.md, forty-third session). Here
the program places its own shared memory and warps. Shared memory: the queries (72 KB), two page buffers filled by
TMA (2 x 72 KB), the scores P (8 KB) and their rescale factors. Warps, by role (warp specialization):
- the scores warpgroup (the default partition) computes each page's scores whole [64 heads, 64 tokens], their
  softmax (its row statistics stay in its registers), passes P and the rescale factors through shared memory, and
  computes the values of the first 256 columns;
- the values warpgroup computes the other 256 columns from that P: page i's values run while the scores warpgroup
  computes page i+1's scores, so the tensor cores see no gap between a page's scores and its values;
- one loader warp issues each page's TMA copy as soon as both warpgroups are done with the buffer.
An mbarrier per handoff: pages ready / free (a buffer each), P ready / free, the row sums at the end.
The form before (8 warps sharing every dot's N, in turn) ran 1.32x slower (BENCHMARKS.md, forty-fifth session).

Where its time goes: while the scores warpgroup runs a page's softmax the tensor cores idle (the values warpgroup
finished the page before by then). Flash-attention 3 hides that softmax under the next page's scores MMAs, but that
holds three pages at once (the page whose values run, the page softmaxed, the next one's scores): 3 x 72 KB beside
the 72 KB of queries is more shared memory than an SM has, and with two buffers the next page's copy could only start
as its scores are due. So the softmax is kept short instead (LEAN_SOFTMAX). An estimate, not measured: every
64x64x16 MMA reads its two operands from shared memory, 4 KB for 32 cycles of tensor work, all of the 128 bytes a
cycle shared memory serves, so narrower MMAs (heads or tokens on an N of 32) should fall short of the tensor rate.

CUDA sm_90 only (TMA, wgmma, setmaxnreg); ROCm and the interpreter keep the Triton kernel.
"""

from __future__ import annotations

import weakref

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_H = 64  # heads a program: one 64-row wgmma tile
HEAD_BLOCK = gl.constexpr(BLOCK_H)  # BLOCK_H inside the kernels
LATENT_WIDTHS, ROPE_WIDTH = (256, 512), 64  # the cache rows it takes (its shared memory is sized for 512 + 64)
MAXNREG = 168  # registers a thread at launch: 3 warpgroups (12 warps) of 168 fill the SM's 64K; then moved by role
VALUES_REGS, LOADER_REGS = gl.constexpr(192), gl.constexpr(24)  # the scores warpgroup takes the rest (256)
# the softmax without the mask on pages inside the context and with the scale folded into the exponent's FFMA
# (about 90 fewer instructions run a page on the scores warpgroup's path): 0.8 / 0.9 % faster at 96 heads on an
# H200 with the host's splits (BENCHMARKS.md, forty-seventh session); False: the softmax before, masked on every page
LEAN_SOFTMAX = True


@gluon.jit
def _copy_page(lat_desc, pe_desc, pt_entry, pred, bar, kl, kp, PAGE: gl.constexpr):
    """Start the TMA copy of the page the page-table entry names (if pred) into kl / kp, counted on bar."""
    page = gl.load(pt_entry, mask=pred, other=0)
    mbarrier.expect(bar, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(lat_desc, [page * PAGE, 0], bar, kl, pred=pred)
    tma.async_copy_global_to_shared(pe_desc, [page * PAGE, 0], bar, kp, pred=pred)


@gluon.jit
def _scores_partition(q_smem, qp_smem, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free, p_ready, p_free,
                      l_ready, n_pages, first, ctx, qk_scale, o_row, lse_row, stride_oh, hb, H, BH: gl.constexpr,
                      PAGE: gl.constexpr, DL: gl.constexpr, LEAN: gl.constexpr):
    """The default partition (4 warps): scores, softmax, values of columns [0, DL/2); the row sums to l_smem."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, PAGE, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DL // 2, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rt = gl.arange(0, PAGE, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([BH], gl.float32, layout=rows_s)
    acc = gl.zeros([BH, DL // 2], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BH, PAGE], gl.float32, layout=s_layout)
    for i in range(n_pages):
        st = i % 2
        mbarrier.wait(kv_ready.index(st), phase=(i // 2) & 1)
        kl = kl_smem.index(st)
        s = warpgroup_mma(q_smem, kl.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma(qp_smem, kp_smem.index(st).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        if LEAN:
            if (first + i + 1) * PAGE > ctx:  # the context's last page: its rows past the end weigh nothing
                s = gl.where(((first + i) * PAGE + rt < ctx)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)  # the scale folded into the exponent's FFMA
            p = gl.exp2(s * qk_scale - m_new[:, None])
        else:
            t_ok = (first + i) * PAGE + rt < ctx
            s = gl.where(t_ok[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        mbarrier.wait(p_free, phase=(i & 1) ^ 1)  # the values warpgroup is past the previous page's P and alpha
        p_smem.store(p.to(p_smem.dtype))
        a_smem.store(alpha)
        fence_async_shared()  # P's generic-proxy stores before either warpgroup's wgmma reads it
        mbarrier.arrive(p_ready, count=1)
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
        acc = warpgroup_mma(p_smem, kl.slice(0, DL // 2, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_free.index(st), count=1)
    l_smem.store(l_i)
    mbarrier.arrive(l_ready, count=1)
    # an empty slice (past the context) leaves l_i = 0: weight 0 in the merge, never a NaN
    safe_l = gl.where(l_i > 0, l_i, 1.0)
    _store_half(acc / gl.convert_layout(safe_l, rows_o)[:, None], o_row, stride_oh, hb, H, 0, BH, DL // 2, o_layout)
    rs = hb * BH + gl.arange(0, BH, layout=rows_s)
    gl.store(lse_row + rs, gl.where(l_i > 0, m_i + gl.log2(safe_l), float("-inf")), mask=rs < H)


@gluon.jit
def _store_half(o, o_row, stride_oh, hb, H, col0, BH: gl.constexpr, DH: gl.constexpr, layout: gl.constexpr):
    """Rows hb·BH.. (those < H) of o_row's [H, DL] block, columns col0..col0+DH."""
    ro = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, layout))
    co = col0 + gl.arange(0, DH, layout=gl.SliceLayout(0, layout))
    gl.store(o_row + ro[:, None] * stride_oh + co[None, :], o.to(o_row.dtype.element_ty), mask=(ro < H)[:, None])


@gluon.jit
def _values_partition(lat_desc, pe_desc, pt_row, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free, p_ready,
                      p_free, l_ready, n_pages, first, o_row, stride_oh, hb, H, BH: gl.constexpr, PAGE: gl.constexpr,
                      DL: gl.constexpr):
    """A worker (4 warps): the values of columns [DL/2, DL) from each page's P and rescale factors."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DL // 2, 16])
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([BH, DL // 2], gl.float32, layout=o_layout)
    for i in range(n_pages):
        st = i % 2
        mbarrier.wait(kv_ready.index(st), phase=(i // 2) & 1)
        mbarrier.wait(p_ready, phase=i & 1)
        acc = acc * a_smem.load(rows_o)[:, None]
        acc = warpgroup_mma(p_smem, kl_smem.index(st).slice(DL // 2, DL // 2, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(kv_free.index(st), count=1)
    mbarrier.wait(l_ready, phase=0)
    l_i = l_smem.load(rows_o)
    _store_half(acc / gl.where(l_i > 0, l_i, 1.0)[:, None], o_row, stride_oh, hb, H, DL // 2, BH, DL // 2, o_layout)


@gluon.jit
def _loader_partition(lat_desc, pe_desc, pt_row, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free, p_ready,
                      p_free, l_ready, n_pages, first, o_row, stride_oh, hb, H, BH: gl.constexpr, PAGE: gl.constexpr,
                      DL: gl.constexpr):
    """A worker (1 warp): page i's copy into buffer i % 2 once both warpgroups are done with page i - 2."""
    for i in range(n_pages):
        st = i % 2
        mbarrier.wait(kv_free.index(st), phase=((i // 2) & 1) ^ 1)
        _copy_page(lat_desc, pe_desc, pt_row + first + i, True, kv_ready.index(st), kl_smem.index(st),
                   kp_smem.index(st), PAGE)


@gluon.jit
def _program_slice(pt_ptr, qseq_ptr, lens_ptr, stride_pb, PAGES_PER_SPLIT, PAGE: gl.constexpr):
    """This program's split, query row b, its context length, its page-table row, first page and page count."""
    split = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    ctx = gl.load(lens_ptr + b)
    pt_row = pt_ptr + gl.load(qseq_ptr + b).to(gl.int64) * stride_pb
    first = split * PAGES_PER_SPLIT
    return split, b, ctx, pt_row, first, gl.minimum(gl.cdiv(ctx, PAGE) - first, PAGES_PER_SPLIT)


@gluon.jit
def _handoff_barriers():
    """The mbarriers of the handoffs: kv_ready / kv_free a page buffer each (both warpgroups release a page), and
    p_ready, p_free, l_ready."""
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    flags = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(kv_ready.index(j), count=1)
        mbarrier.init(kv_free.index(j), count=2)
    for j in gl.static_range(3):
        mbarrier.init(flags.index(j), count=1)
    return kv_ready, kv_free, flags.index(0), flags.index(1), flags.index(2)


@gluon.jit
def _load_queries(q_smem, qp_smem, q_lat_ptr, q_pe_ptr, b, hb, H, stride_qb, stride_qh, stride_rb, stride_rh,
                  BH: gl.constexpr, DL: gl.constexpr, DR: gl.constexpr, num_warps: gl.constexpr):
    """Query row b's heads hb·64 .. hb·64 + BH (zeros past H) into shared memory, a quarter of the latent columns at a
    time (fewer registers than all at once), fenced for the MMAs that read them."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rh = hb * HEAD_BLOCK + gl.arange(0, BH, layout=gl.SliceLayout(1, ld))
    h_ok = (rh < H)[:, None]
    q_row = q_lat_ptr + b * stride_qb + rh[:, None] * stride_qh
    for c in gl.static_range(4):
        rl = c * (DL // 4) + gl.arange(0, DL // 4, layout=gl.SliceLayout(0, ld))
        q_smem.slice(c * (DL // 4), DL // 4, dim=1).store(gl.load(q_row + rl[None, :], mask=h_ok, other=0.0))
    rr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld))
    qp_smem.store(gl.load(q_pe_ptr + b * stride_rb + rh[:, None] * stride_rh + rr[None, :], mask=h_ok, other=0.0))
    fence_async_shared()  # the queries' generic-proxy stores before wgmma's async-proxy reads


@gluon.jit
def mla_decode_sm90_kernel(q_lat_ptr, q_pe_ptr, lat_desc, pe_desc, pt_ptr, qseq_ptr, lens_ptr, o_ptr, lse_ptr,
                           qk_scale, H, stride_qb, stride_qh, stride_rb, stride_rh, stride_pb, stride_ob, stride_os,
                           stride_oh, stride_lb, stride_ls, PAGES_PER_SPLIT, BH: gl.constexpr, PAGE: gl.constexpr,
                           DL: gl.constexpr, DR: gl.constexpr, LEAN: gl.constexpr, num_warps: gl.constexpr):
    """o_part / lse of one 64-head block, split and query row (launch's); num_warps 4 is the scores warpgroup, the
    values warpgroup and the loader warp come with it."""
    hb = gl.program_id(0)
    split, b, ctx, pt_row, first, n_pages = _program_slice(pt_ptr, qseq_ptr, lens_ptr, stride_pb, PAGES_PER_SPLIT, PAGE)
    dt: gl.constexpr = lat_desc.dtype

    q_smem = gl.allocate_shared_memory(dt, [BH, DL], lat_desc.layout)
    qp_smem = gl.allocate_shared_memory(dt, [BH, DR], pe_desc.layout)
    kl_smem = gl.allocate_shared_memory(dt, [2, PAGE, DL], lat_desc.layout)
    kp_smem = gl.allocate_shared_memory(dt, [2, PAGE, DR], pe_desc.layout)
    p_smem = gl.allocate_shared_memory(dt, [BH, PAGE], pe_desc.layout)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    a_smem = gl.allocate_shared_memory(gl.float32, [BH], vec)
    l_smem = gl.allocate_shared_memory(gl.float32, [BH], vec)
    kv_ready, kv_free, p_ready, p_free, l_ready = _handoff_barriers()

    _load_queries(q_smem, qp_smem, q_lat_ptr, q_pe_ptr, b, hb, H, stride_qb, stride_qh, stride_rb, stride_rh, BH, DL,
                  DR, num_warps)

    o_row = o_ptr + b * stride_ob + split * stride_os
    lse_row = lse_ptr + b * stride_lb + split * stride_ls
    # the workers' arguments, one list for both (their signatures must match); each tuple is written out in the call
    # (one tuple built first and passed twice reached the partitions with its constexprs turned into tensors)
    gl.warp_specialize([
        (_scores_partition, (q_smem, qp_smem, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free, p_ready,
                             p_free, l_ready, n_pages, first, ctx, qk_scale, o_row, lse_row, stride_oh, hb, H, BH, PAGE,
                             DL, LEAN)),
        (_values_partition, (lat_desc, pe_desc, pt_row, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free,
                             p_ready, p_free, l_ready, n_pages, first, o_row, stride_oh, hb, H, BH, PAGE, DL)),
        (_loader_partition, (lat_desc, pe_desc, pt_row, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free,
                             p_ready, p_free, l_ready, n_pages, first, o_row, stride_oh, hb, H, BH, PAGE, DL)),
    ], [4, 1], [VALUES_REGS, LOADER_REGS])


# The last head block of a head count with 32 left over (96 = 64 + 32; NARROW_REMAINDER): a 64-row MMA tile would
# hold 32 padding heads, a quarter of the math the two 64-row blocks do. This form puts the heads on the MMA's N
# instead ("swap AB"): the scores transposed, S^T [64 tokens, 32 heads] = K · Q^T, the softmax down the tokens, the
# values transposed, O^T [512, 32] = V^T · P^T (each warpgroup 256 of the rows); the same roles, barriers and loader
# as above. Its programs take less time than the 64-row blocks' beside them: a gain where the grid has more programs
# than SMs (splits), so that the SMs they free take the next ones. Two programs of 48 heads on N each (96 heads with
# no padding at all) cannot be written: a Gluon register tensor's dimensions are powers of two, so S^T [64, 48] and
# O^T [256, 48] are refused at compile time ("shape must have power-of-2 ... dimensions", tried on triton 3.6).
# Scores in e4m3 (twice the MMA rate) would end the padding's cost, but drift past the parity bar (rel-L2 0.04-0.11
# against bf16's 0.003-0.008; tools/mla_fp8_drift.py, BENCHMARKS.md's fifty-sixth session).
NARROW = 32
# off: on an H200 1.8 % faster at 64 x 8K without splits, 11 % slower at 32 x 64K with the two splits the host
# picks there (BENCHMARKS.md, forty-seventh session); its GPU tests pass
NARROW_REMAINDER = False


@gluon.jit
def _narrow_scores_partition(q_smem, qp_smem, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free, p_ready,
                             p_free, l_ready, n_pages, first, ctx, qk_scale, o_row, lse_row, stride_oh, hb, H,
                             BH: gl.constexpr, PAGE: gl.constexpr, DL: gl.constexpr, LEAN: gl.constexpr):
    """The default partition: S^T, its softmax down the tokens, the values' rows [0, DL/2) of O^T."""
    # S^T and O^T both put the heads on N: one layout, so the per-head vectors need no conversion between them
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    cols: gl.constexpr = gl.SliceLayout(0, layout)
    rt = gl.arange(0, PAGE, layout=gl.SliceLayout(1, layout))
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=cols)
    l_i = gl.zeros([BH], gl.float32, layout=cols)
    acc = gl.zeros([DL // 2, BH], gl.float32, layout=layout)
    zero_s = gl.zeros([PAGE, BH], gl.float32, layout=layout)
    for i in range(n_pages):
        st = i % 2
        mbarrier.wait(kv_ready.index(st), phase=(i // 2) & 1)
        kl = kl_smem.index(st)
        s = warpgroup_mma(kl, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma(kp_smem.index(st), qp_smem.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        if LEAN:
            if (first + i + 1) * PAGE > ctx:
                s = gl.where(((first + i) * PAGE + rt < ctx)[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[None, :])
        else:
            t_ok = (first + i) * PAGE + rt < ctx
            s = gl.where(t_ok[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0))
            p = gl.exp2(s - m_new[None, :])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        mbarrier.wait(p_free, phase=(i & 1) ^ 1)
        p_smem.store(p.to(p_smem.dtype))
        a_smem.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
        acc = acc * alpha[None, :]
        acc = warpgroup_mma(kl.slice(0, DL // 2, dim=1).permute((1, 0)), p_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_free.index(st), count=1)
    l_smem.store(l_i)
    mbarrier.arrive(l_ready, count=1)
    safe_l = gl.where(l_i > 0, l_i, 1.0)
    _store_transposed(acc / safe_l[None, :], o_row, stride_oh, hb, H, 0, BH, DL // 2, layout)
    rs = hb * HEAD_BLOCK + gl.arange(0, BH, layout=cols)
    gl.store(lse_row + rs, gl.where(l_i > 0, m_i + gl.log2(safe_l), float("-inf")), mask=rs < H)


@gluon.jit
def _store_transposed(o_t, o_row, stride_oh, hb, H, col0, BH: gl.constexpr, DH: gl.constexpr, layout: gl.constexpr):
    """o_t [DH columns, BH heads] into o_row's [H, DL] block: heads hb·64.. (those < H), columns col0..col0+DH."""
    co = col0 + gl.arange(0, DH, layout=gl.SliceLayout(1, layout))
    ro = hb * HEAD_BLOCK + gl.arange(0, BH, layout=gl.SliceLayout(0, layout))
    gl.store(o_row + ro[None, :] * stride_oh + co[:, None], o_t.to(o_row.dtype.element_ty), mask=(ro < H)[None, :])


@gluon.jit
def _narrow_values_partition(lat_desc, pe_desc, pt_row, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free,
                             p_ready, p_free, l_ready, n_pages, first, o_row, stride_oh, hb, H, BH: gl.constexpr,
                             PAGE: gl.constexpr, DL: gl.constexpr):
    """A worker (4 warps): the rows [DL/2, DL) of O^T from each page's P^T and rescale factors."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    acc = gl.zeros([DL // 2, BH], gl.float32, layout=o_layout)
    for i in range(n_pages):
        st = i % 2
        mbarrier.wait(kv_ready.index(st), phase=(i // 2) & 1)
        mbarrier.wait(p_ready, phase=i & 1)
        acc = acc * a_smem.load(cols_o)[None, :]
        acc = warpgroup_mma(kl_smem.index(st).slice(DL // 2, DL // 2, dim=1).permute((1, 0)), p_smem, acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(kv_free.index(st), count=1)
    mbarrier.wait(l_ready, phase=0)
    l_i = l_smem.load(cols_o)
    _store_transposed(acc / gl.where(l_i > 0, l_i, 1.0)[None, :], o_row, stride_oh, hb, H, DL // 2, BH, DL // 2,
                      o_layout)


@gluon.jit
def mla_decode_sm90_narrow_kernel(q_lat_ptr, q_pe_ptr, lat_desc, pe_desc, pt_ptr, qseq_ptr, lens_ptr, o_ptr, lse_ptr,
                                  qk_scale, H, stride_qb, stride_qh, stride_rb, stride_rh, stride_pb, stride_ob,
                                  stride_os, stride_oh, stride_lb, stride_ls, PAGES_PER_SPLIT, HB0,
                                  BH: gl.constexpr, PAGE: gl.constexpr, DL: gl.constexpr, DR: gl.constexpr,
                                  LEAN: gl.constexpr, num_warps: gl.constexpr):
    """mla_decode_sm90_kernel with a narrow last head block: programs 0 .. HB0-1 (grid dimension 0) the 64-row
    blocks, program HB0 heads HB0·64 .. HB0·64 + BH (BH = NARROW) on the MMA's N. One launch, so that a query's
    blocks run side by side and read its pages from HBM once (two launches would run one after the other, each
    reading them); the two bodies' shared memory is placed once (the larger)."""
    if gl.program_id(0) < HB0:
        mla_decode_sm90_kernel(q_lat_ptr, q_pe_ptr, lat_desc, pe_desc, pt_ptr, qseq_ptr, lens_ptr, o_ptr, lse_ptr,
                               qk_scale, H, stride_qb, stride_qh, stride_rb, stride_rh, stride_pb, stride_ob, stride_os,
                               stride_oh, stride_lb, stride_ls, PAGES_PER_SPLIT, HEAD_BLOCK, PAGE, DL, DR, LEAN,
                               num_warps)
    else:
        _narrow_program(q_lat_ptr, q_pe_ptr, lat_desc, pe_desc, pt_ptr, qseq_ptr, lens_ptr, o_ptr, lse_ptr, qk_scale,
                        H, stride_qb, stride_qh, stride_rb, stride_rh, stride_pb, stride_ob, stride_os, stride_oh,
                        stride_lb, stride_ls, PAGES_PER_SPLIT, BH, PAGE, DL, DR, LEAN, num_warps)


@gluon.jit
def _narrow_program(q_lat_ptr, q_pe_ptr, lat_desc, pe_desc, pt_ptr, qseq_ptr, lens_ptr, o_ptr, lse_ptr, qk_scale, H,
                    stride_qb, stride_qh, stride_rb, stride_rh, stride_pb, stride_ob, stride_os, stride_oh, stride_lb,
                    stride_ls, PAGES_PER_SPLIT, BH: gl.constexpr, PAGE: gl.constexpr, DL: gl.constexpr,
                    DR: gl.constexpr, LEAN: gl.constexpr, num_warps: gl.constexpr):
    """The narrow block's program: heads hb·64 .. hb·64 + BH, hb its grid index."""
    hb = gl.program_id(0)
    split, b, ctx, pt_row, first, n_pages = _program_slice(pt_ptr, qseq_ptr, lens_ptr, stride_pb, PAGES_PER_SPLIT, PAGE)
    dt: gl.constexpr = lat_desc.dtype

    q_smem = gl.allocate_shared_memory(dt, [BH, DL], gl.NVMMASharedLayout.get_default_for([BH, DL], dt))
    qp_smem = gl.allocate_shared_memory(dt, [BH, DR], gl.NVMMASharedLayout.get_default_for([BH, DR], dt))
    kl_smem = gl.allocate_shared_memory(dt, [2, PAGE, DL], lat_desc.layout)
    kp_smem = gl.allocate_shared_memory(dt, [2, PAGE, DR], pe_desc.layout)
    p_smem = gl.allocate_shared_memory(dt, [PAGE, BH], gl.NVMMASharedLayout.get_default_for([PAGE, BH], dt))
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    a_smem = gl.allocate_shared_memory(gl.float32, [BH], vec)
    l_smem = gl.allocate_shared_memory(gl.float32, [BH], vec)
    kv_ready, kv_free, p_ready, p_free, l_ready = _handoff_barriers()

    _load_queries(q_smem, qp_smem, q_lat_ptr, q_pe_ptr, b, hb, H, stride_qb, stride_qh, stride_rb, stride_rh, BH, DL,
                  DR, num_warps)

    o_row = o_ptr + b * stride_ob + split * stride_os
    lse_row = lse_ptr + b * stride_lb + split * stride_ls
    gl.warp_specialize([
        (_narrow_scores_partition, (q_smem, qp_smem, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free,
                                    p_ready, p_free, l_ready, n_pages, first, ctx, qk_scale, o_row, lse_row,
                                    stride_oh, hb, H, BH, PAGE, DL, LEAN)),
        (_narrow_values_partition, (lat_desc, pe_desc, pt_row, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready,
                                    kv_free, p_ready, p_free, l_ready, n_pages, first, o_row, stride_oh, hb, H, BH,
                                    PAGE, DL)),
        (_loader_partition, (lat_desc, pe_desc, pt_row, kl_smem, kp_smem, p_smem, a_smem, l_smem, kv_ready, kv_free,
                             p_ready, p_free, l_ready, n_pages, first, o_row, stride_oh, hb, H, BH, PAGE, DL)),
    ], [4, 1], [VALUES_REGS, LOADER_REGS])


def supports(q_lat: torch.Tensor, kv_cache: torch.Tensor) -> tuple[bool, str]:
    """bf16/fp16 on a CUDA sm_90 device; K3's widths (latent 256 or 512, rope 64)."""
    if q_lat.dtype != kv_cache.dtype:
        return False, "the Gluon MLA kernel takes queries in the cache's dtype"
    return runs_on(kv_cache, q_lat.shape[-1])


def runs_on(kv_cache: torch.Tensor, dl: int) -> tuple[bool, str]:
    """Whether the kernel takes this cache (latent width dl) on its device."""
    cuda = kv_cache.is_cuda and torch.version.hip is None
    if not (cuda and torch.cuda.get_device_capability(kv_cache.device)[0] == 9):
        return False, "the Gluon MLA kernel runs on CUDA sm_90 only"
    dr = kv_cache.shape[-1] - dl
    if dl not in LATENT_WIDTHS or dr != ROPE_WIDTH:
        return False, f"the Gluon MLA kernel takes latent 256 or 512 and rope 64, got {dl} and {dr}"
    if kv_cache.dtype not in (torch.bfloat16, torch.float16):
        return False, "the Gluon MLA kernel takes a bf16 or fp16 cache"
    return True, ""


# page_descriptors' answers by the cache tensor (its id): a layer's cache is one tensor for the engine's life, and
# building the two descriptors costs ~40 us of host time a launch on a 2-core CPU, every eager step and MLA layer.
# An entry goes with its tensor (weakref.finalize); it is used only while the tensor's storage, shape and dtype
# are those it was built for.
_DESCRIPTORS: dict[int, tuple] = {}


def page_descriptors(kv_cache: torch.Tensor, dl: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of a page's latent [64, dl] and rope [64, dr] parts, over the cache as [pages·64, dl + dr]
    (built once a cache tensor and latent width)."""
    key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype, dl)
    hit = _DESCRIPTORS.get(id(kv_cache))
    if hit is not None and hit[0] == key:
        return hit[1]
    descriptors = _build_page_descriptors(kv_cache, dl)
    if hit is None:
        weakref.finalize(kv_cache, _DESCRIPTORS.pop, id(kv_cache), None)
    _DESCRIPTORS[id(kv_cache)] = (key, descriptors)
    return descriptors


def _build_page_descriptors(kv_cache: torch.Tensor, dl: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    pages, page, width = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise ValueError("mla_decode (gluon): the kv cache must be contiguous")
    # over the storage, not a view: a view would hold kv_cache itself, and page_descriptors' entry would keep it alive
    rows = torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device).set_(
        kv_cache.untyped_storage(), kv_cache.storage_offset(), (pages * page, width), (width, 1))
    dt = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16
    lat = TensorDescriptor(rows, [pages * page, dl], [width, 1], [page, dl],
                           gl.NVMMASharedLayout.get_default_for([page, dl], dt))
    pe = TensorDescriptor(rows[:, dl:], [pages * page, width - dl], [width, 1], [page, width - dl],
                          gl.NVMMASharedLayout.get_default_for([page, width - dl], dt))
    return lat, pe


def launch(q_lat, q_pe, kv_cache, page_table, query_seq, context_lens, o_part, lse, scale: float,
           pages_per_split: int) -> None:
    """o_part [B, splits, H, dl] (fp32 partials, or the output itself with one split) and lse [B, splits, H]
    (log2) for each 64-head block and split (with NARROW_REMAINDER, a last block of at most 32 heads on the MMA's N,
    in the same launch)."""
    B, H, dl = q_lat.shape
    lat, pe = page_descriptors(kv_cache, dl)
    full, rest = divmod(H, BLOCK_H)
    narrow = NARROW_REMAINDER and 0 < rest <= NARROW  # the last block's heads on the MMA's N
    args = (q_lat, q_pe, lat, pe, page_table, query_seq, context_lens, o_part, lse, float(scale) * 1.4426950408889634,
            H, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), page_table.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1), pages_per_split)
    shape = dict(PAGE=kv_cache.shape[1], DL=dl, DR=kv_cache.shape[2] - dl, LEAN=LEAN_SOFTMAX, num_warps=4,
                 maxnreg=MAXNREG)
    if narrow:
        mla_decode_sm90_narrow_kernel[(full + 1, o_part.shape[1], B)](*args, full, BH=NARROW, **shape)
    else:
        mla_decode_sm90_kernel[(-(-H // BLOCK_H), o_part.shape[1], B)](*args, BH=BLOCK_H, **shape)
