"""Absorbed-MLA paged attention in Triton (split-K over the context, then a log-sum-exp merge), and the MLA
mixer built on it (the engine's "triton" tactic).

Cache: kv_cache [num_pages, 64, 576] = [normed latent 512 | k_pe 64] per token (K3_SPEC.md §2.3; other
power-of-two widths for small test models). Each program owns one query row, one block of heads and one
slice of its pages, so every cached token is read from HBM once per head block (the head blocks of one
slice are adjacent in the grid and share it in L2). Prefill rows are queries too: each new token attends
to its sequence's cache up to its own position, so one kernel serves chunked prefill and decode, and the
mixer needs no device->host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3plugins.embed.dense import dense
from k3plugins.norm.triton import rms_norm, rms_norm_row, row_warps  # the q latent norm: one launch, not five
from k3plugins.pdl import pdl, pdl_prologue
from k3plugins.step_scope import per_step

from . import prefill
from .reference import in_proj_rows, split_in_proj

PAGE = 64


@triton.jit
def _barrier_zero(i, PTX_BAR: tl.constexpr):
    """A CTA barrier that returns 0, for addresses to depend on. As PTX (CUDA): tl.debug_barrier in the loop stops
    Triton pipelining its loads, and the dependence keeps the loads after the barrier. Elsewhere (ROCm, the
    interpreter) tl.debug_barrier."""
    if PTX_BAR:
        zero = tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;", "=r,r", [i], dtype=tl.int32, is_pure=False,
                                         pack=1)
    else:
        tl.debug_barrier()
        zero = 0
    return zero


@triton.jit
def mla_decode_kernel(q_lat_ptr, q_pe_ptr, kv_ptr, pt_ptr, qseq_ptr, lens_ptr, o_ptr, lse_ptr, sm_scale, H,
                      stride_qb, stride_qh, stride_rb, stride_rh, stride_pb, stride_kv_page, stride_ob, stride_os, stride_oh,
                      stride_lb, stride_ls, PAGES_PER_SPLIT, BH: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, PDL: tl.constexpr = False,
                      xp_ptr=None, xa_ptr=None, XCHG: tl.constexpr = False,
                      PTX_BAR: tl.constexpr = False):
    pdl_prologue(PDL)
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # b * a row stride passes 2^31 at about 100K tokens of 96 heads
    ctx = tl.load(lens_ptr + b)
    pt_row = pt_ptr + tl.load(qseq_ptr + b).to(tl.int64) * stride_pb  # the query's sequence
    first_page = split * PAGES_PER_SPLIT
    n_pages = tl.minimum(tl.cdiv(ctx, PAGE_SIZE) - first_page, PAGES_PER_SPLIT)
    offs_h = hb * BH + tl.arange(0, BH)
    h_mask = offs_h < H
    rl = tl.arange(0, DL)
    rr = tl.arange(0, DR)
    rt = tl.arange(0, PAGE_SIZE)
    q_off = b * stride_qb + offs_h[:, None] * stride_qh
    q = tl.load(q_lat_ptr + q_off + rl[None, :], mask=h_mask[:, None], other=0.0)      # [BH, DL]
    qp_off = b * stride_rb + offs_h[:, None] * stride_rh
    qp = tl.load(q_pe_ptr + qp_off + rr[None, :], mask=h_mask[:, None], other=0.0)     # [BH, DR]
    # fold the softmax scale and log2(e) into one multiply so the loop uses exp2
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, DL), dtype=tl.float32)
    for i in range(0, n_pages):
        page = tl.load(pt_row + first_page + i).to(tl.int64)
        base = kv_ptr + page * stride_kv_page + rt[:, None] * (DL + DR)
        c = tl.load(base + rl[None, :])                                                  # [T, DL]
        cp = tl.load(base + DL + rr[None, :])                                            # [T, DR]
        if DR >= 16 and XCHG:  # scaled apart, so that Triton does not chain one dot into the other
            s = tl.dot(q, tl.trans(c)) * qk_scale + tl.dot(qp, tl.trans(cp)) * qk_scale
        elif DR >= 16:
            s = tl.dot(q, tl.trans(c)) + tl.dot(qp, tl.trans(cp))                        # [BH, T]
        else:  # an MMA needs K >= 16: small test models' rope parts are summed directly
            s = tl.dot(q, tl.trans(c)) + tl.sum(qp[:, None, :].to(tl.float32) * cp[None, :, :].to(tl.float32), 2)
        t_ok = (first_page + i) * PAGE_SIZE + rt < ctx
        s = tl.where(t_ok[None, :], s if XCHG and DR >= 16 else s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if XCHG:
            # the scores reach the values' dot through a per-program scratch (L2), not as an SSA value: Triton
            # then splits each dot's N over the warpgroups instead of computing the scores in both
            slot = ((tl.program_id(2) * tl.num_programs(1) + split) * tl.num_programs(0) + hb) * 2 + i % 2
            rh = tl.arange(0, BH)
            xp = xp_ptr + slot.to(tl.int64) * (BH * PAGE_SIZE) + rh[:, None] * PAGE_SIZE + rt[None, :]
            xa = xa_ptr + slot.to(tl.int64) * BH + rh
            tl.store(xp, p.to(c.dtype))
            tl.store(xa, alpha)
            zero = _barrier_zero(i, PTX_BAR)
            acc = tl.dot(tl.load(xp + zero), c, acc * tl.load(xa + zero)[:, None])
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    # an empty slice (past the context) leaves l_i = 0: weight 0 in the merge, never a NaN
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o_off = b * stride_ob + split * stride_os + offs_h[:, None] * stride_oh + rl[None, :]
    tl.store(o_ptr + o_off, (acc / safe_l[:, None]).to(o_ptr.dtype.element_ty), mask=h_mask[:, None])
    lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + split * stride_ls + offs_h, lse, mask=h_mask)


@triton.jit
def mla_merge_kernel(o_part_ptr, lse_ptr, out_ptr, H, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
                     stride_ob, stride_oh, NUM_SPLITS: tl.constexpr, DL: tl.constexpr, PDL: tl.constexpr = False):
    """out[b, h] = Σ_s 2^(lse_s − max) o_s / Σ_s 2^(lse_s − max)."""
    pdl_prologue(PDL)
    h = tl.program_id(0)
    b = tl.program_id(1)
    rs = tl.arange(0, NUM_SPLITS)
    lse = tl.load(lse_ptr + b * stride_lb + rs * stride_ls + h)
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    rl = tl.arange(0, DL)
    o = tl.load(o_part_ptr + b * stride_pb + rs[:, None] * stride_ps + h * stride_ph + rl[None, :])
    tl.store(out_ptr + b * stride_ob + h * stride_oh + rl, tl.sum(o * w[:, None], 0).to(out_ptr.dtype.element_ty))


@triton.jit
def mla_cache_write_kernel(ckv_ptr, w_ptr, kv_ptr, page_ptr, row_ptr, R, DR, stride_t, stride_page, stride_row, eps,
                           BR: tl.constexpr, BDR: tl.constexpr, NORM_DTYPE: tl.constexpr, PDL: tl.constexpr = False,
                           clear_ptr=None, PAGE_SIZE: tl.constexpr = 64):
    """kv[page[t], row[t]] = [rms_norm(ckv[t, :R]) | ckv[t, R:R+DR]], a token a program: the latent norm, the concat
    and the paged store of the mixer in one launch (they were three). The norm rounds as norm/triton.py's (launched
    with its warps, so its sum adds in the same order) and its result goes through NORM_DTYPE (the dtype the
    separate norm returned) before the cache's dtype, so the cache holds the same bits as before. A token with no
    page (page < 0: a scheduler's bug) writes nothing rather than outside the cache. With clear_ptr, token t also
    zeroes its page's rows clear[t] ... PAGE_SIZE - 1 (none where clear[t] = PAGE_SIZE)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    page = tl.load(page_ptr + t)
    paged = page >= 0
    src = ckv_ptr + t * stride_t
    dst = kv_ptr + tl.maximum(page, 0) * stride_page + tl.load(row_ptr + t) * stride_row
    kv_dt = kv_ptr.dtype.element_ty
    offs = tl.arange(0, BR)
    mask = offs < R
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    y = rms_norm_row(x, w_ptr, offs, mask, R, eps, ckv_ptr.dtype.element_ty)
    tl.store(dst + offs, y.to(NORM_DTYPE).to(kv_dt), mask=mask & paged)
    offs_r = tl.arange(0, BDR)
    mask_r = offs_r < DR
    pe = tl.load(src + R + offs_r, mask=mask_r, other=0.0)
    tl.store(dst + R + offs_r, pe.to(NORM_DTYPE).to(kv_dt), mask=mask_r & paged)
    if clear_ptr is not None:
        page_base = kv_ptr + tl.maximum(page, 0) * stride_page
        for row in range(tl.load(clear_ptr + t).to(tl.int32), PAGE_SIZE):
            tl.store(page_base + row * stride_row + offs, tl.zeros([BR], kv_dt), mask=mask & paged)
            tl.store(page_base + row * stride_row + R + offs_r, tl.zeros([BDR], kv_dt), mask=mask_r & paged)


@triton.jit
def mla_gate_kernel(o_ptr, g_ptr, out_ptr, VD, stride_oh, stride_ot, stride_gt, stride_out,
                    BV: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, h·VD + v] = o[h, t, v] · sigmoid(g[t, h·VD + v]) (o as the value bmm leaves it, head-major), a
    (token, head) a program: the reshape copy, the sigmoid and the product in one launch (they were three). The
    sigmoid is rounded to g's dtype first, as torch's two launches did. Without HAS_GATE, only the copy."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BV)
    mask = offs < VD
    o = tl.load(o_ptr + h * stride_oh + t * stride_ot + offs, mask=mask, other=0.0)
    col = h * VD + offs
    if HAS_GATE:
        g = tl.load(g_ptr + t * stride_gt + col, mask=mask, other=0.0)
        s = tl.sigmoid(g.to(tl.float32)).to(g.dtype)
        o = (o.to(tl.float32) * s.to(tl.float32))
    tl.store(out_ptr + t * stride_out + col, o.to(out_ptr.dtype.element_ty), mask=mask)


# the grid num_splits_for aims at, in programs per SM: each split adds a partial output [H, 512] fp32 a query that
# the merge reads again (at 64 x 8K with 16 heads, 8 splits' are about 3 % of the KV bytes). On the H200 one wave
# against two: 0.893 / 0.854 of the KV floor at 64 x 8K (16 heads), 1.022 / 1.013 at 32 x 64K, 0.270 / 0.262 at
# 96 heads; in a K3 rank 0.12-0.24 ms a step less (BENCHMARKS.md, thirty-fifth session)
SPLIT_WAVES = 1
MAX_GRID_ROWS = 65535  # CUDA's limit on a grid's second and third dimensions


def num_splits_for(batch: int, num_heads: int, max_pages: int, *, block_h: int = 16, num_sms: int = 132,
                   full: float = 1.0) -> int:
    """Split count (a power of two) that gives the grid about SPLIT_WAVES waves without slices under 4 pages; a
    wave counts as full at `full` of the SMs."""
    programs = batch * triton.cdiv(num_heads, block_h)
    splits = 1
    while programs * splits < full * SPLIT_WAVES * num_sms and max_pages >= 8 * splits:
        splits *= 2
    return splits


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(q_lat: torch.Tensor, kv_cache: torch.Tensor) -> tuple[bool, str]:
    """K3 is [*, 64, 512 + 64]; any power-of-two latent (>= 16) and rope widths run."""
    dl = q_lat.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[1] != PAGE or not kv_cache.shape[2] > dl:
        return False, f"kv_cache must be [num_pages, {PAGE}, {dl} + rope], got {tuple(kv_cache.shape)}"
    if not (_pow2(dl) and dl >= 16 and _pow2(kv_cache.shape[2] - dl)):
        return False, f"latent {dl} (>= 16) and rope {kv_cache.shape[2] - dl} widths must be powers of two"
    if q_lat.dtype not in (torch.bfloat16, torch.float16, torch.float32) or kv_cache.dtype != q_lat.dtype:
        return False, f"q_lat/kv_cache dtypes {q_lat.dtype}/{kv_cache.dtype} must match (bf16, fp16 or fp32)"
    return True, ""


def mla_decode_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                         context_lens: torch.Tensor, *, scale: float, query_seq: torch.Tensor | None = None,
                         num_splits: int | None = None, block_h: int | None = None, num_warps: int | None = None,
                         num_stages: int = 2, exchange: bool | None = None, kernel: str = "triton") -> torch.Tensor:
    """softmax(scale·(q_lat·c_latᵀ + q_pe·k_peᵀ)) · c_lat over each sequence's cached tokens.

    Args:
        q_lat: [B, H, 512] absorbed queries; q_pe: [B, H, 64].
        kv_cache: [num_pages, 64, 576] paged latent cache.
        page_table: int32 [N, max_pages]; context_lens: int32 [B] (>= 1), the tokens query b attends to.
        query_seq: int32 [B], the page-table row of each query (default: row b; prefill rows of one sequence
            share its row).
        scale: softmax scale (K3: 192^-0.5).
        num_splits: split-K factor (power of two); None picks one from the shapes (no device sync).
        block_h, num_warps, num_stages: the tactic (heads per program and its launch shape).
        exchange: the scores reach the values' dot through an L2 scratch, so that each warpgroup computes its
            share of them rather than all of them (Triton's chained dots put both warpgroups on the same 64 rows).
            None: on for 64-head blocks of 8 warps on CUDA (2-3 % faster at 96 heads on an H100).
        kernel: "triton" (portable) or "gluon" (gluon_sm90: CUDA sm_90, bf16/fp16, 64-head blocks; block_h,
            num_warps, num_stages and exchange do not apply).

    Returns:
        o_lat [B, H, 512] in q_lat.dtype.
    """
    ok, why = supports(q_lat, kv_cache)
    if not ok:
        raise ValueError(f"mla_decode_attention: {why}")
    B, H, dl = q_lat.shape
    dr = kv_cache.shape[2] - dl
    if q_pe.shape != (B, H, dr):
        raise ValueError(f"mla_decode_attention: q_pe must be [{B}, {H}, {dr}], got {tuple(q_pe.shape)}")
    max_pages = page_table.shape[1]
    if kernel not in ("triton", "gluon"):
        raise ValueError(f"mla_decode_attention: kernel must be 'triton' or 'gluon', got {kernel!r}")
    if kernel == "gluon":
        from . import gluon_sm90  # Hopper-only module: imported where used
        ok, why = gluon_sm90.supports(q_lat, kv_cache)
        if not ok:
            raise ValueError(f"mla_decode_attention: {why}")
        block_h = gluon_sm90.BLOCK_H
    elif block_h is None:  # measured on H200: 64 heads x 8 warps for 96 heads, 16 x 4 for 16
        block_h, num_warps = (64, num_warps or 8) if H >= 64 else (16, num_warps or 4)
    num_warps = num_warps or 4
    nvidia = q_lat.is_cuda and torch.version.hip is None  # the exchange's barrier as PTX
    if exchange is None:
        exchange = block_h == 64 and num_warps == 8 and nvidia
    # the Gluon kernel (one program an SM) takes 128 programs on 132 SMs as a wave: one split, written in place,
    # at 96 heads x 64 requests rather than two (3 % faster, BENCHMARKS.md)
    splits = num_splits or num_splits_for(B, H, max_pages, block_h=block_h, full=0.9 if kernel == "gluon" else 1.0)
    pps = triton.cdiv(max_pages, splits)
    # the kernel takes row and head strides: a bmm's transposed output or a column slice needs no copy
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    if query_seq is None:
        query_seq = torch.arange(B, dtype=torch.int32, device=q_lat.device)
    out = torch.empty(B, H, dl, dtype=q_lat.dtype, device=q_lat.device)
    # one split: the kernel's normalised output is the answer, written in place (no fp32 partials, no merge: at
    # 96 heads and 64 x 8K they are 12.6 MB written and read again)
    o_part = out.unsqueeze(1) if splits == 1 else torch.empty(B, splits, H, dl, dtype=torch.float32,
                                                              device=q_lat.device)
    lse = torch.empty(B, splits, H, dtype=torch.float32, device=q_lat.device)
    # the query rows are the grid's last dimension, which CUDA caps at 65535: a step with more (a prefill chunk past
    # 64K tokens) is launched over slices of rows
    for r0 in range(0, B, MAX_GRID_ROWS):
        rows = slice(r0, r0 + MAX_GRID_ROWS)
        args = (q_lat[rows], q_pe[rows], kv_cache, page_table, query_seq[rows], context_lens[rows], o_part[rows],
                lse[rows], scale, pps)
        if kernel == "gluon":
            gluon_sm90.launch(*args)
        else:
            grid = (triton.cdiv(H, block_h), splits, args[0].shape[0])
            _launch_triton(*args, grid, block_h, num_warps, num_stages, exchange, nvidia)
        if splits > 1:
            part, ls, dst = o_part[rows], lse[rows], out[rows]
            mla_merge_kernel[(H, dst.shape[0])](part, ls, dst, H, part.stride(0), part.stride(1), part.stride(2),
                                                ls.stride(0), ls.stride(1), dst.stride(0), dst.stride(1),
                                                NUM_SPLITS=splits, DL=dl, num_warps=4, **pdl(part))
    return out


def _launch_triton(q_lat, q_pe, kv_cache, page_table, query_seq, context_lens, o_part, lse, scale, pps, grid, block_h,
                   num_warps, num_stages, exchange, nvidia):
    _, H, dl = q_lat.shape
    dr = kv_cache.shape[2] - dl
    splits, B = grid[1], grid[2]
    xp = xa = None
    if exchange:  # two buffers a program: a program's next page may start before every warp read this one's
        xp = torch.empty(grid[0] * splits * B * 2, block_h * PAGE, dtype=q_lat.dtype, device=q_lat.device)
        xa = torch.empty(grid[0] * splits * B * 2, block_h, dtype=torch.float32, device=q_lat.device)
    mla_decode_kernel[grid](
        q_lat, q_pe, kv_cache, page_table, query_seq, context_lens, o_part, lse, float(scale), H, q_lat.stride(0),
        q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), page_table.stride(0), kv_cache.stride(0), o_part.stride(0), o_part.stride(1),
        o_part.stride(2), lse.stride(0), lse.stride(1), PAGES_PER_SPLIT=pps, BH=block_h, PAGE_SIZE=PAGE,
        DL=dl, DR=dr, num_warps=num_warps, num_stages=num_stages, xp_ptr=xp, xa_ptr=xa, XCHG=exchange,
        PTX_BAR=exchange and nvidia,
        **pdl(q_lat))


def _token_index(cu_seqlens: torch.Tensor, context_lens: torch.Tensor, page_table: torch.Tensor, T: int):
    """For a step's T tokens: the cache page and row each writes, the row from which it clears the rest of its page
    (write_cache), the page table, the attended length and the sequence of each token as the decode kernel takes
    them (the same for every MLA layer of the step)."""
    # token t of sequence n sits at position context_lens[n] - (cu[n+1] - t)
    cu = cu_seqlens.to(torch.int64)
    tok = torch.arange(T, device=cu.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)                              # [T]
    end = cu[seq + 1]
    pos = context_lens.to(torch.int64)[seq] - (end - tok)
    row = pos % PAGE
    # a sequence's last token of the step clears the rest of its page when the step began that page (its first
    # new token at the page's row 0 or before): the kernels multiply a zero probability by each row of a sequence's
    # last page, and a NaN that the page's earlier owner left past this one's rows would poison them
    began = pos - (tok - cu[seq]) <= pos - row                                     # first new position <= page start
    clear = torch.where((tok == end - 1) & began, row + 1, torch.full_like(row, PAGE))
    return (page_table.to(torch.int64)[seq, pos // PAGE], row, clear, page_table.to(torch.int32),
            (pos + 1).to(torch.int32), seq.to(torch.int32))


def mla_mixer(x: torch.Tensor, in_proj_weight: torch.Tensor, q_a_norm_weight: torch.Tensor | None,
              q_b_weight: torch.Tensor | None, kv_a_norm_weight: torch.Tensor, w_uk: torch.Tensor,
              w_uv: torch.Tensor, o_weight: torch.Tensor, kv_cache: torch.Tensor, *, cu_seqlens: torch.Tensor,
              context_lens: torch.Tensor, page_table: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
              qk_rope_head_dim: int, v_head_dim: int, scale: float, latent_eps: float,
              output_gate: int, host_seqs: tuple[tuple[int, int], ...] | None = None,
              decode_kernel: str = "triton") -> torch.Tensor:
    """See reference.mla_mixer: same arguments and result, with no device->host sync (the reference checks
    page tables on the host; here every index is computed on the device). host_seqs: each sequence's (new tokens,
    context length) as the host knows them (an eager step's; None in a CUDA graph): a sequence with
    prefill.min_new_tokens(H, context) new tokens or more is attended in the un-absorbed form (prefill.py), the others
    absorbed.
    decode_kernel: mla_decode_attention's kernel (the "gluon" tactic's mixer, mla_mixer_gluon, passes "gluon")."""
    T = x.shape[0]
    H, nope, rope, vd = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    r = kv_a_norm_weight.shape[0]
    # q_a, kv_a and the gate all read x: one GEMM (a launch and a pass over x instead of three)
    rows = in_proj_rows(H, nope, rope, vd, r, q_a_norm_weight, output_gate)
    q_src, ckv, gate = split_in_proj(dense(x, in_proj_weight), rows)
    if q_b_weight is not None:
        q_src = dense(rms_norm(q_src, q_a_norm_weight, eps=latent_eps), q_b_weight)
    q = q_src.view(T, H, nope + rope)
    page, row, clear, pages32, lens32, seq32 = per_step("mla_index", (cu_seqlens, context_lens, page_table),
                                                        lambda *src: _token_index(*src, T))
    write_cache(ckv, kv_a_norm_weight, kv_cache, page, row, eps=latent_eps, clear_from=clear)
    unabsorbed = prefill.sequences(host_seqs, cu_seqlens, T, H)
    absorbed = (lambda rows=None: _absorbed(q, rows, w_uk, w_uv, kv_cache, pages32, lens32, seq32, nope=nope,
                                            scale=scale, kernel=decode_kernel))
    if not unabsorbed:
        return dense(gate_heads(absorbed(), gate), o_weight)
    o = torch.empty(T, H, vd, dtype=x.dtype, device=x.device)
    rest = prefill.other_rows(unabsorbed, T, x.device)
    if rest is not None:
        o.index_copy_(0, rest, absorbed(rest).transpose(0, 1))
    prefill.attend_sequences(q, kv_cache, page_table, unabsorbed, w_uk, w_uv, scale=scale, out=o)
    return dense(gate_heads(o.transpose(0, 1), gate), o_weight)


def _absorbed(q: torch.Tensor, rows: torch.Tensor | None, w_uk: torch.Tensor, w_uv: torch.Tensor,
              kv_cache: torch.Tensor, pages32: torch.Tensor, lens32: torch.Tensor, seq32: torch.Tensor, *, nope: int,
              scale: float, kernel: str) -> torch.Tensor:
    """The absorbed attention of the step's query rows (`rows`: int64 indices, None for all): o [H, rows, v]."""
    if rows is not None:
        q, lens32, seq32 = q.index_select(0, rows), lens32.index_select(0, rows), seq32.index_select(0, rows)
    # q_lat stays the bmm's head-major output ([H, T, r] seen as [T, H, r]): the attention kernel takes strides
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk.to(q.dtype)).transpose(0, 1)
    o_lat = mla_decode_attention(q_lat.to(kv_cache.dtype), q[..., nope:].to(kv_cache.dtype), kv_cache, pages32,
                                 lens32, scale=scale, query_seq=seq32, kernel=kernel)
    return torch.bmm(o_lat.transpose(0, 1).to(q.dtype), w_uv.to(q.dtype))                # [H, T, v]


def write_cache(ckv: torch.Tensor, norm_weight: torch.Tensor, kv_cache: torch.Tensor, page: torch.Tensor,
                row: torch.Tensor, *, eps: float, clear_from: torch.Tensor | None = None) -> None:
    """kv_cache[page, row] = [rms_norm(ckv[:, :r]) | ckv[:, r:]] in one launch (page, row: int64 [T]); with
    clear_from (int64 [T]), token t also zeroes rows clear_from[t] onwards of its page."""
    T, width = ckv.shape
    r = norm_weight.shape[0]
    if ckv.stride(-1) != 1 or kv_cache.stride(-1) != 1 or width != kv_cache.shape[-1]:
        raise ValueError(f"write_cache: ckv [T, {width}] and the cache's rows ({kv_cache.shape[-1]}) must match, "
                         "with unit column strides")
    if T:
        norm_dtype = _TL[torch.promote_types(norm_weight.dtype, ckv.dtype)]
        mla_cache_write_kernel[(T,)](ckv, norm_weight.contiguous(), kv_cache, page, row, r, width - r, ckv.stride(0),
                                     kv_cache.stride(0), kv_cache.stride(1), float(eps),
                                     BR=triton.next_power_of_2(r), BDR=triton.next_power_of_2(width - r),
                                     NORM_DTYPE=norm_dtype, num_warps=row_warps(triton.next_power_of_2(r)),
                                     clear_ptr=clear_from, PAGE_SIZE=kv_cache.shape[1], **pdl(ckv))


def gate_heads(o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """o [H, T, v] (head-major) -> [T, H·v], times sigmoid(gate [T, H·v]) when the layer has the output gate."""
    H, T, vd = o.shape
    if o.stride(-1) != 1 or (gate is not None and gate.stride(-1) != 1):
        raise ValueError("gate_heads: o and gate need unit column strides")
    out = torch.empty(T, H * vd, dtype=o.dtype, device=o.device)
    if T:
        mla_gate_kernel[(T, H)](o, gate if gate is not None else o, out, vd, o.stride(0), o.stride(1),
                                gate.stride(0) if gate is not None else 0, out.stride(0),
                                BV=triton.next_power_of_2(vd), HAS_GATE=gate is not None, num_warps=1, **pdl(o))
    return out


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def mla_mixer_gluon(x: torch.Tensor, in_proj_weight: torch.Tensor, q_a_norm_weight: torch.Tensor | None,
                    q_b_weight: torch.Tensor | None, kv_a_norm_weight: torch.Tensor, w_uk: torch.Tensor,
                    w_uv: torch.Tensor, o_weight: torch.Tensor, kv_cache: torch.Tensor, *, cu_seqlens: torch.Tensor,
                    context_lens: torch.Tensor, page_table: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
                    qk_rope_head_dim: int, v_head_dim: int, scale: float, latent_eps: float,
                    output_gate: int, host_seqs: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """The engine's "gluon" MLA tactic (sm90): this mixer, its decode attention on the Gluon kernel (gluon_sm90)
    where the rank holds a 64-head block or more (2x the Triton kernel at 96 heads, BENCHMARKS.md) and the kernel
    takes its cache, else on the Triton kernel (its 16-head blocks: a 64-row block would compute mostly padding)."""
    from . import gluon_sm90  # Hopper-only module: imported where used
    gluon = num_heads >= gluon_sm90.BLOCK_H and gluon_sm90.runs_on(kv_cache, kv_a_norm_weight.shape[0])[0]
    return mla_mixer(x, in_proj_weight, q_a_norm_weight, q_b_weight, kv_a_norm_weight, w_uk, w_uv, o_weight, kv_cache,
                     cu_seqlens=cu_seqlens, context_lens=context_lens, page_table=page_table, num_heads=num_heads,
                     qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                     scale=scale, latent_eps=latent_eps, output_gate=output_gate,
                     decode_kernel="gluon" if gluon else "triton", host_seqs=host_seqs)
