"""Triton kernels under the CPU interpreter (TRITON_INTERPRET=1), fp32/fp16 only (numpy has no bf16).

Covers the MoE dequant + tl.dot path (tl.dot_scaled has no interpreter support; test_moe_gpu.py runs it),
the MLA split-K decode, the KDA decode steps, the KDA prefill conv kernels, the norms, the GLU, the router and the
latent MoE's output projection, each against its torch reference (fla-core's own kernels need a GPU:
test_kda_gpu.py). The interpreter must be on
before the first `import triton` of a process (triton.language's own @jit helpers are decorated then), so the checks
run in child processes started with the variable set (two at once, each with half the work); each test reads its
result.
"""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def _patch_interpreter():
    """numpy >= 2.4 refuses int() of a 1-element array, which Triton 3.6's interpreter does for range() bounds."""
    import numpy as np
    import triton.runtime.interpreter as ti
    orig = ti._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    ti._patch_lang_tensor = patched


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _moe_case(moe, dtype, act, entry=None):
    """entry: the registry's function (named tactic fitted to the shape) instead of an explicit tactic."""
    from k3plugins.moe.reference import moe_experts as ref
    g = torch.Generator().manual_seed(0)
    M, k, E, e_global, start, dl, inter = 7, 4, 6, 11, 3, (64 if entry else 128), 64
    z = torch.randn(M, dl, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e_global, generator=g)[:k] for _ in range(M)])
    ids[0, :] = torch.tensor([0, 1, 2, 10])  # a token with no local expert
    w = torch.rand(M, k, generator=g)
    w13 = torch.randint(0, 256, (E, 2 * inter, dl // 2), dtype=torch.uint8, generator=g)
    s13 = torch.randint(118, 128, (E, 2 * inter, dl // 32), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (E, dl, inter // 2), dtype=torch.uint8, generator=g)
    s2 = torch.randint(116, 124, (E, dl, inter // 32), dtype=torch.uint8, generator=g)
    if entry:  # the tiny model's expert dims (64): the named tactic's 256/128 blocks must shrink to fit
        out = entry(z, ids, w, w13, s13, w2, s2, expert_start=start, act=act)
    else:
        tactic = moe.MoETactic(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1, w4=True)
        out = moe.moe_experts(z, ids, w, w13, s13, w2, s2, expert_start=start, act=act, tactic=tactic)
    expect = ref(z.float(), ids, w, w13, s13, w2, s2, expert_start=start, act=act)
    return {"rel": _rel(out, expect), "token0_zero": bool(torch.equal(out[0], torch.zeros(dl)))}


def _sort_pairs_case(moe, max_block=256, cols=None, tokens=300):
    """The counting sort against a stable torch sort: ragged experts, empty ones, pairs of other ranks' experts,
    more pairs than one block (several chunks per program; max_block 2048: all in one, read once); cols: the
    kernel's tile width (None: the host's)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 40, (tokens, 4), generator=g)  # experts 10..29 are local: about half the pairs are not
    ids[:, 0] = 12  # a crowded expert; experts 10 and 11 stay empty when their ids never come up
    ids[ids == 10] = 3
    done = torch.full((20,), 7, dtype=torch.int32)  # the overlap's per-expert counts: zeroed by the same launch
    order, offsets, inv = moe.sort_pairs(ids, 10, 20, max_block=max_block, done=done, cols=cols)
    key = ids.reshape(-1) - 10
    key = torch.where((key >= 0) & (key < 20), key, 20)
    want = torch.sort(key, stable=True).indices
    local = int((key < 20).sum())
    want_inv = torch.empty_like(want)
    want_inv[want] = torch.arange(want.numel())
    want_inv = torch.where(key < 20, want_inv, -1)
    return {"order": torch.equal(order[:local].long(), want[:local]),
            "offsets": torch.equal(offsets.long(), torch.searchsorted(key.sort().values, torch.arange(21))),
            "inv": torch.equal(inv.long(), want_inv), "empty": int(offsets[1] - offsets[0]) == 0,
            "done_zeroed": not done.any().item()}


def _combine_case(moe, top_k):
    """moe_combine_kernel on its own, both ways (GATHER and the loop), against torch: each token's rows of y at its
    positions (-1: not local; a token with none), top_k not a power of two too (the gather pads it)."""
    import triton
    from k3plugins.moe.triton_kernels import moe_combine_kernel
    g = torch.Generator().manual_seed(9)
    M, P, Dl, bd = 6, 40, 80, 32
    y = torch.randn(P, Dl, generator=g)
    inv = torch.randint(-1, P, (M, top_k), generator=g).int()
    inv[0] = -1
    want = torch.stack([sum((y[p] for p in row if p >= 0), torch.zeros(Dl)) for row in inv.tolist()])
    res = {}
    for gather in (False, True):
        out = torch.empty(M, Dl)
        moe_combine_kernel[(M, triton.cdiv(Dl, bd))](y, inv, out, Dl, y.stride(0), out.stride(0), TOP_K=top_k, BD=bd,
                                                     GATHER=gather)
        res["gather" if gather else "loop"] = _rel(out, want)
    return res


def _moe_strided_case(moe, dtype, paired=False, tiled=False, rows_first=False, block_n=None, overlap=False,
                      down_block_n=None, lane=False, y_half=False, gather_combine=False):
    """The strided-nibble tactic on restride_mxfp4 weights (K tiles of 256; paired: the paired tactic on
    pair_mxfp4's; tiled: the paired bytes and the scales in row tiles, two tiles a program along rows and K, or
    block_n rows: half a tile at 32) vs the reference on the originals. rows_first: the grid (row blocks, experts).
    overlap: the down kernel awaits each expert's count of gate/up programs (the counts must add up, or it hangs).
    down_block_n: the down kernel's own rows per program. lane: lane_mxfp4's layout, z given in its K order.
    y_half: the per-pair rows in z's dtype; also returns its distance from the same tactic with fp32 rows.
    gather_combine: the combine gathering a token's rows at once; also returns its distance from the loop's."""
    from k3plugins.moe.reference import moe_experts as ref
    g = torch.Generator().manual_seed(6)
    M, k, E, start, dl, inter = 9, 2, 3, 1, 512 if tiled else 256, 256
    z = torch.randn(M, dl, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(5, generator=g)[:k] for _ in range(M)])
    w = torch.rand(M, k, generator=g)
    w13 = torch.randint(0, 256, (E, 2 * inter, dl // 2), dtype=torch.uint8, generator=g)
    s13 = torch.randint(118, 128, (E, 2 * inter, dl // 32), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (E, dl, inter // 2), dtype=torch.uint8, generator=g)
    s2 = torch.randint(116, 124, (E, dl, inter // 32), dtype=torch.uint8, generator=g)
    tactic = moe.MoETactic(block_m=16, block_n=block_n or (128 if tiled else 32), block_k=256, num_warps=4,
                           num_stages=1, strided=True, paired=paired or tiled, tiled=tiled, rows_first=rows_first,
                           overlap=overlap, down_block_n=down_block_n, lane=lane, y_half=y_half,
                           gather_combine=gather_combine)
    out = moe.moe_experts(moe.lay_out_input(tactic, z), ids, w, moe.lay_out(tactic, w13),
                          moe.lay_out_scale(tactic, s13), moe.lay_out(tactic, w2), moe.lay_out_scale(tactic, s2),
                          expert_start=start, act="situ", tactic=tactic)
    expect = ref(z.float(), ids, w, w13, s13, w2, s2, expert_start=start, act="situ")
    if not (y_half or gather_combine):
        return {"rel": _rel(out, expect)}
    from dataclasses import replace
    other = moe.moe_experts(moe.lay_out_input(tactic, z), ids, w, moe.lay_out(tactic, w13),
                            moe.lay_out_scale(tactic, s13), moe.lay_out(tactic, w2), moe.lay_out_scale(tactic, s2),
                            expert_start=start, act="situ", tactic=replace(tactic, y_half=False, gather_combine=False))
    return {"rel": _rel(out, expect), "rel_fp32_y" if y_half else "rel_loop": _rel(out, other)}


def _mla_case(mla, splits, exchange=False):
    g = torch.Generator().manual_seed(2)
    B, H, max_pages, num_pages = 3, 5, 4, 20
    lens = torch.tensor([1, 70, 256], dtype=torch.int32)
    kv = torch.randn(num_pages, 64, 576, generator=g)
    pt = torch.randperm(num_pages, generator=g)[: B * max_pages].view(B, max_pages).int()
    ql, qp = torch.randn(B, H, 512, generator=g), torch.randn(B, H, 64, generator=g)
    out = mla.mla_decode_attention(ql, qp, kv, pt, lens, scale=192 ** -0.5, num_splits=splits, exchange=exchange)
    rels = []
    for b in range(B):
        toks = kv[pt[b].long()].reshape(-1, 576)[: int(lens[b])].double()
        s = (ql[b].double() @ toks[:, :512].T + qp[b].double() @ toks[:, 512:].T) * 192 ** -0.5
        rels.append(_rel(out[b], torch.softmax(s, -1) @ toks[:, :512]))
    return {"rel": max(rels)}


def _mla_mixer_case(mla, dims=(16, 8, 16), new=(5, 1, 3), ctx=(75, 1, 3), pages=((3, 6, -1), (1, -1, -1), (7, -1, -1)),
                    host_seqs=False, poison=(), num_pages=8):
    """The Triton mixer vs the reference on one packed step (by default a prefill chunk continuing 70 cached tokens,
    a first decode token, a fresh 3-token prefill); the caches must end equal too. dims: (nope, rope, v).
    host_seqs: the step's host lengths given (the mixer may take the un-absorbed prefill form). poison: (page, row)
    pairs from which the cache holds NaN before the step (an earlier owner's). num_pages: the cache's."""
    from k3plugins.mla.reference import mla_mixer as ref
    g = torch.Generator().manual_seed(5)
    r_ = lambda *sh, sc=1.0: torch.randn(*sh, generator=g) * sc
    (nope, rope, vd), H, r, hid, ql = dims, 3, 32, 32, 24
    w = (r_(ql, hid, sc=hid ** -0.5), 1 + 0.1 * r_(ql), r_(H * (nope + rope), ql, sc=ql ** -0.5),
         r_(r + rope, hid, sc=hid ** -0.5), 1 + 0.1 * r_(r), r_(H, nope, r, sc=nope ** -0.5), r_(H, r, vd, sc=r ** -0.5),
         r_(H * vd, hid, sc=hid ** -0.5), r_(hid, H * vd, sc=(H * vd) ** -0.5))
    cu = torch.tensor((0,) + tuple(new)).cumsum(0)
    x = r_(int(cu[-1]), hid)
    cache = r_(num_pages, 64, r + rope)
    for page, row in poison:
        cache[page, row:] = float("nan")
    pt = torch.tensor(pages, dtype=torch.int32)
    outs = []
    q_a, q_a_norm, q_b, kv_a, kv_a_norm, w_uk, w_uv, g_w, o_w = w
    in_proj = torch.cat([q_a, kv_a, g_w])  # the builder's stacking
    for fn in (mla.mla_mixer, ref):
        c = cache.clone()
        o = fn(x, in_proj, q_a_norm, q_b, kv_a_norm, w_uk, w_uv, o_w, c, cu_seqlens=cu, context_lens=torch.tensor(ctx),
               page_table=pt, num_heads=H, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=vd,
               scale=(nope + rope) ** -0.5, latent_eps=1e-6, output_gate=1,
               host_seqs=tuple(zip(new, ctx)) if host_seqs else None)
        outs.append((o, c))
    (o1, c1), (o2, c2) = outs
    return {"rel": _rel(o1, o2), "cache_rel": _rel(c1, c2)}


def _mla_unabsorbed_cases(mla):
    """The mixer with the host's lengths, its prefill sequences in the un-absorbed form (prefill.py) beside an
    absorbed decode token, against the reference: contexts of one piece and of three (pieces of one page; the
    chunk's first rows precede the last piece, so its merge keeps what they had), an odd v width, a rope part
    under an MMA's 16 and one over it. `calls`: the un-absorbed sequences (the others went the absorbed way)."""
    from k3plugins.mla import prefill
    calls, groups, run, run_varlen = [], [], prefill.mha_prefill, prefill.mha_prefill_varlen
    knobs = (prefill.MIN_NEW_TOKENS, prefill.KEY_PIECE_BYTES, prefill.SPLIT_DIAGONAL, prefill.SHARED_LAUNCH)
    prefill.mha_prefill = lambda q, *a, **k: (calls.append(q.shape[0]), run(q, *a, **k))[1]

    def varlen(q, cache, pages, group, *a, **k):
        rows = [end - start for _, start, end, _ in group]
        calls.extend(rows)
        groups.append(rows)
        return run_varlen(q, cache, pages, group, *a, **k)

    prefill.mha_prefill_varlen = varlen
    res = {}
    try:
        prefill.MIN_NEW_TOKENS = 8
        step = dict(new=(40, 1, 20), ctx=(150, 1, 20), pages=((3, 6, 2), (1, -1, -1), (7, -1, -1)), host_seqs=True)
        # shared: prefill.SHARED_LAUNCH (the sequences in one launch where their contexts fit a piece together)
        for name, dims, piece_bytes, split, shared in (
                ("one-piece", (16, 8, 16), 1 << 30, False, False), ("pieces", (16, 8, 16), 1, False, True),
                ("odd-v", (8, 16, 24), 1, False, True), ("one-piece-split", (16, 8, 16), 1 << 30, True, False),
                ("one-piece-shared", (16, 8, 16), 1 << 30, False, True),
                ("one-piece-shared-split", (16, 8, 16), 1 << 30, True, True),
                ("one-piece-shared-odd-v", (8, 16, 24), 1 << 30, True, True),
                ("pieces-split", (8, 16, 24), 1, True, True)):
            prefill.KEY_PIECE_BYTES, prefill.SPLIT_DIAGONAL, prefill.SHARED_LAUNCH = piece_bytes, split, shared
            calls.clear()
            groups.clear()
            res[f"mla-unabsorbed-{name}"] = {**_mla_mixer_case(mla, dims, **step), "calls": list(calls),
                                             "varlen": list(groups)}
        # the engine's own thresholds: four prompts of 64 to 192 new tokens (512 between them) take the MHA form
        # together (prefill.TOGETHER_LEAST) beside a decode token; with one token fewer, every row is absorbed
        prefill.MIN_NEW_TOKENS, prefill.KEY_PIECE_BYTES, prefill.SPLIT_DIAGONAL, prefill.SHARED_LAUNCH = knobs
        for name, last in (("together", 128), ("together-too-few", 127)):
            calls.clear()
            groups.clear()
            step = dict(new=(128, 64, 1, 192, last), ctx=(128, 100, 30, 192, last), num_pages=10, host_seqs=True,
                        pages=((0, 1, -1), (2, 3, -1), (4, -1, -1), (5, 6, 7), (8, 9, -1)))
            res[f"mla-unabsorbed-{name}"] = {**_mla_mixer_case(mla, **step), "calls": list(calls),
                                             "varlen": list(groups)}
    finally:
        prefill.mha_prefill, prefill.mha_prefill_varlen = run, run_varlen
        (prefill.MIN_NEW_TOKENS, prefill.KEY_PIECE_BYTES, prefill.SPLIT_DIAGONAL, prefill.SHARED_LAUNCH) = knobs
    return res


def _mha_prefill_out_dtype_case(pieces: bool):
    """mha_prefill into an fp16 row slice of a wider buffer (the last piece writes `out` itself, earlier pieces an
    fp32 running output) against the same call into fp32: equal up to fp16 rounding, the rows around untouched."""
    from k3plugins.mla import prefill
    g = torch.Generator().manual_seed(11)
    H, nope, rope, vd, r, T, context = 2, 16, 8, 16, 32, 24, 150
    q = torch.randn(T, H, nope + rope, generator=g)
    cache = torch.randn(4, 64, r + rope, generator=g)
    w_uk, w_uv = torch.randn(H, nope, r, generator=g) * r ** -0.5, torch.randn(H, r, vd, generator=g) * r ** -0.5
    page_row = torch.tensor([2, 0, 3], dtype=torch.int32)
    knob, prefill.KEY_PIECE_BYTES = prefill.KEY_PIECE_BYTES, 1 if pieces else 1 << 30
    try:
        outs = []
        for dtype in (torch.float32, torch.float16):
            buf = torch.full((T + 2, H, vd), 7.0, dtype=dtype)
            prefill.mha_prefill(q, cache, page_row, context, w_uk, w_uv, scale=0.2, out=buf[1:T + 1])
            outs.append(buf)
    finally:
        prefill.KEY_PIECE_BYTES = knob
    want, got = outs
    return {"rel": _rel(got[1:T + 1], want[1:T + 1]),
            "around_kept": bool((got[0] == 7).all() and (got[T + 1] == 7).all())}


def _mla_cache_write_case(mla):
    """The fused cache write against rms_norm + cat + index_put, fp32; a token with no page (-1) writes nothing."""
    from k3plugins.norm.reference import rms_norm
    g = torch.Generator().manual_seed(7)
    ckv, w = torch.randn(3, 40, generator=g), 1 + 0.1 * torch.randn(32, generator=g)
    page, row = torch.tensor([2, -1, 0]), torch.tensor([5, 6, 63])
    cache = torch.randn(4, 64, 40, generator=g)
    want = cache.clone()
    keep = page >= 0
    want[page[keep], row[keep]] = torch.cat([rms_norm(ckv[:, :32], w, eps=1e-6), ckv[:, 32:]], -1)[keep]
    mla.write_cache(ckv, w, cache, page, row, eps=1e-6)
    res = {"rel": _rel(cache, want),
           "untouched": bool(torch.equal(cache[1], want[1]) and torch.equal(cache[3], want[3]))}
    # clear_from: token 0 zeroes rows 6.. of page 2, token 1 (no page) nothing, token 2 (row 63) nothing after it
    cleared = cache.clone()
    mla.write_cache(ckv, w, cleared, page, row, eps=1e-6, clear_from=torch.tensor([6, 7, 64]))
    want[2, 6:] = 0
    return {**res, "cleared": bool(torch.equal(cleared, want))}


def _kda_layer(g, N, H, K, hid, S):
    r = lambda *sh, sc=1.0: torch.randn(*sh, generator=g) * sc
    D = H * K
    w = [r(3 * D + K + H + D, hid, sc=hid ** -0.5), r(3 * D, 4, sc=0.5), r(D, K, sc=K ** -0.5), r(H, sc=0.5),
         r(D, sc=0.5), None, 1 + 0.1 * r(K), r(hid, D, sc=D ** -0.5)]
    return w, r(S, H, K, K, sc=0.1), r(S, 3 * D, 3), r(N, hid)


def _kda_decode_case(kd, lower_bound, tactic):
    """tactic "split-wide": the split tactic with decode_block_v's wide slice (BLOCK_V) at this small grid;
    "fused-f-b-gemm": the fused tactic on the f_b GEMM's output (past F_B_FUSED_MAX_PROGRAMS), not f_a."""
    from k3plugins.kda.reference import kda_mixer
    narrow_below, f_b_max = kd.NARROW_BELOW, kd.F_B_FUSED_MAX_PROGRAMS
    if tactic == "split-wide":
        tactic, kd.NARROW_BELOW = "split", 0
    if tactic == "fused-f-b-gemm":
        tactic, kd.F_B_FUSED_MAX_PROGRAMS = "fused", 0
    g = torch.Generator().manual_seed(3)
    N, H, K, hid, S = 3, 2, 64, 32, 5
    w, rec, conv, x = _kda_layer(g, N, H, K, hid, S)
    slots, cu = torch.tensor([4, 0, 2]), torch.arange(N + 1)
    outs, f_b_given = [], []
    decode = kd.kda_decode  # spied on: was f_b applied inside the fused kernel?
    kd.kda_decode = lambda *a, **kw: f_b_given.append(kw.get("f_b_weight") is not None) or decode(*a, **kw)
    try:  # the "fla" tactic runs fla-core's kernel: GPU only
        for fn in (functools.partial(kd.kda_mixer, decode_tactic=tactic), kda_mixer):
            a, b = rec.clone(), conv.clone()
            o = fn(x, *w, a, b, cu_seqlens=cu, slot_ids=slots, num_heads=H, head_dim=K, lower_bound=lower_bound,
                   eps=1e-5)
            outs.append((o, a, b))
    finally:
        kd.NARROW_BELOW, kd.F_B_FUSED_MAX_PROGRAMS, kd.kda_decode = narrow_below, f_b_max, decode
    (o1, a1, b1), (o2, a2, b2) = outs
    return {"rel": _rel(o1, o2), "state_rel": _rel(a1, a2), "conv_equal": bool(torch.equal(b1, b2)),
            "f_b_inside": f_b_given == [True]}


def _kda_conv_prefill_case(kd, norm_k: int = 0, lens=(2, 0, 11, 1)):
    """norm_k > 0: the conv also L2-norms the q and k planes over heads of norm_k channels (v stays as it is)."""
    import triton
    from k3plugins.kda.reference import _l2norm, short_conv
    from k3plugins.kda.triton_decode import conv_prefill_rows_kernel, conv_state_kernel
    g = torch.Generator().manual_seed(4)
    C, S, BC = 96, 6, 64  # conv_state: two channel blocks, the second half masked
    cu = torch.tensor([0, *lens]).cumsum(0)
    T = int(cu[-1])
    x, w, pool = torch.randn(T, C, generator=g), torch.randn(C, 4, generator=g), torch.randn(S, C, 3, generator=g)
    slots = torch.tensor([5, 1, 3, 0][:len(lens)], dtype=torch.int32)
    tok_seq = torch.searchsorted(cu[1:], torch.arange(T), right=True).to(torch.int32)
    y3, new = torch.empty(3, T, C // 3), pool.clone()
    # BT=4 < T=14: row blocks straddle sequence boundaries (their first rows reload the window), [8, 12) lies
    # 6 rows into its sequence (the one-sequence walk), the last is part-masked; tiles of 16 channels (they must
    # divide D = 32), two per plane. lens (1, 17): [4, 8) to [16, 18) take the one-sequence walk, the last masked
    conv_prefill_rows_kernel[(triton.cdiv(T, 4), C // 16)](x, w, new, slots, cu, tok_seq, y3, T, x.stride(0),
                                                           new.stride(0), C, C // 3, W=4, BT=4, BC=16, NORM_K=norm_k)
    y = y3.permute(1, 0, 2).reshape(T, C)
    conv_state_kernel[(len(lens), 2)](x, new, slots, cu, x.stride(0), new.stride(0), C, W=4, BC=BC)
    rels, same = [], True
    for n, sl in enumerate(slots.tolist()):
        s, e = int(cu[n]), int(cu[n + 1])
        if e == s:  # an empty chunk leaves its slot as it was
            same &= bool(torch.equal(new[sl], pool[sl]))
            continue
        ref_y, ref_state = short_conv(x[s:e], w, pool[sl])
        if norm_k:
            qk = _l2norm(ref_y[:, :2 * C // 3].reshape(e - s, -1, norm_k)).reshape(e - s, -1)
            ref_y = torch.cat([qk, ref_y[:, 2 * C // 3:]], 1)
        rels.append(_rel(y[s:e], ref_y))
        same &= bool(torch.allclose(new[sl], ref_state))
    return {"rel": max(rels), "state_equal": same}


def _norm_cases() -> dict:
    """RMSNorm (rows of a 3-D input, fp16 rounding before the weight) and AttnRes (K = 0, 1, 5) vs references."""
    from k3plugins.attn_res import reference as ar_ref
    from k3plugins.attn_res import triton as ar
    from k3plugins.norm import reference as norm_ref
    from k3plugins.norm import triton as norm
    g = torch.Generator().manual_seed(5)
    res = {}
    for dtype in (torch.float32, torch.float16):
        name = str(dtype)[6:]
        x, w = torch.randn(2, 5, 96, generator=g).to(dtype), (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
        got, want = norm.rms_norm(x, w, eps=1e-5), norm_ref.rms_norm(x, w, eps=1e-5)
        res[f"rmsnorm-{name}"] = {"rel": _rel(got, want), "dtype_ok": got.dtype == want.dtype,
                                  "shape_ok": got.shape == want.shape}
        for k in (0, 1, 5, 8, 11):  # 11 > MAX_BLOCK_PTRS: the kernel reads them stacked
            partial, blocks = torch.randn(7, 96, generator=g).to(dtype), torch.randn(k, 7, 96, generator=g).to(dtype)
            proj, nw = torch.randn(96, generator=g), 1 + 0.1 * torch.randn(96, generator=g)
            want = ar_ref.attn_res(partial, blocks, proj, nw, eps=1e-6)
            got = ar.attn_res(partial, blocks, proj, nw, eps=1e-6, split=0)               # one program a token
            # the executor's form: K separate tensors (each its own allocation), read in place, in the engine's
            # form for 7 tokens (use_split: the split form, one part-masked chunk of 512)
            got_list = ar.attn_res(partial, [b.clone() for b in blocks], proj, nw, eps=1e-6)
            # the split form: D = 96 in chunks of 32 (three a token), D = 112 (four, the last half masked)
            got_split = ar.attn_res(partial, [b.clone() for b in blocks], proj, nw, eps=1e-6, split=32)
            wide = torch.randn(7, 112, generator=g).to(dtype)
            wide_blocks = torch.randn(k, 7, 112, generator=g).to(dtype)
            p112, n112 = torch.randn(112, generator=g), 1 + 0.1 * torch.randn(112, generator=g)
            rel_wide = _rel(ar.attn_res(wide, wide_blocks, p112, n112, eps=1e-6, split=32),
                            ar_ref.attn_res(wide, wide_blocks, p112, n112, eps=1e-6)) if k else 0.0
            # the residual add fused (delta): both forms give the reference's output and exactly its running sum
            delta = torch.randn(7, 96, generator=g).to(dtype)
            want_d, want_sum = ar_ref.attn_res(partial, blocks, proj, nw, eps=1e-6, delta=delta)
            fused = {split: ar.attn_res(partial, [b.clone() for b in blocks], proj, nw, eps=1e-6, split=split,
                                        delta=delta) for split in (0, 32)}
            res[f"attnres-{name}-{k}"] = {"rel": _rel(got, want), "dtype_ok": got.dtype == want.dtype,
                                          "rel_list": _rel(got_list, want), "rel_split": _rel(got_split, want),
                                          "rel_split_masked": rel_wide,
                                          "rel_delta": max(_rel(o, want_d) for o, _ in fused.values()),
                                          "sum_exact": all(torch.equal(t, want_sum) for _, t in fused.values())}
            res[f"attnres-norm-{name}-{k}"] = _attn_res_norm_case(ar, ar_ref, norm, partial, blocks, proj, nw, delta, g)
    return res


def _attn_res_norm_case(ar, ar_ref, norm, partial, blocks, proj, nw, delta, g) -> dict:
    """The next RMSNorm fused into AttnRes (out_norm) in both forms (split=32: the mix of all three chunks in one
    program a token), with and without delta, vs the reference, and vs the unfused path (the mix stored, then
    norm.rms_norm): the same rounding at the same points, so under the interpreter the same values."""
    ow = (1 + 0.1 * torch.randn(partial.shape[1], generator=g)).to(partial.dtype)
    kw = dict(eps=1e-6, out_norm=ow, out_eps=1e-5)
    want, (want_d, want_sum) = ar_ref.attn_res(partial, blocks, proj, nw, **kw), \
        ar_ref.attn_res(partial, blocks, proj, nw, delta=delta, **kw)
    rel, rel_d, exact, sum_exact, dtype_ok = [], [], True, True, True
    for split in (0, 32):
        got = ar.attn_res(partial, [b.clone() for b in blocks], proj, nw, split=split, **kw)
        got_d, got_sum = ar.attn_res(partial, [b.clone() for b in blocks], proj, nw, split=split, delta=delta, **kw)
        mixed = ar.attn_res(partial, [b.clone() for b in blocks], proj, nw, eps=1e-6, split=split)
        mixed_d, _ = ar.attn_res(partial, [b.clone() for b in blocks], proj, nw, eps=1e-6, split=split, delta=delta)
        rel += [_rel(got, want)]
        rel_d += [_rel(got_d, want_d)]
        exact &= torch.equal(got, norm.rms_norm(mixed, ow, eps=1e-5))
        exact &= torch.equal(got_d, norm.rms_norm(mixed_d, ow, eps=1e-5))
        sum_exact &= torch.equal(got_sum, want_sum)
        dtype_ok &= got.dtype == got_d.dtype == want.dtype
    return {"rel": max(rel), "rel_delta": max(rel_d), "unfused_exact": bool(exact), "sum_exact": bool(sum_exact),
            "dtype_ok": bool(dtype_ok)}


def _glu_cases() -> dict:
    """The GLU kernel against reference.glu: both activations, a width that is not a power of two (masked
    columns), a strided input (h a column slice of a wider buffer) and no rows."""
    from k3plugins.mlp import reference as mlp_ref
    from k3plugins.mlp import triton as mlp
    g = torch.Generator().manual_seed(6)
    res = {}
    for dtype in (torch.float32, torch.float16):
        for act in ("situ", "silu"):
            wide = (torch.randn(5, 2 * 48 + 8, generator=g) * 8).to(dtype)
            h = wide[:, :96]                                                   # row stride 104, not 96
            got = mlp.glu(h, act=act, beta=4.0, linear_beta=25.0)
            want = mlp_ref.glu(h[:, :48], h[:, 48:], act=act, beta=4.0, linear_beta=25.0)
            empty = mlp.glu(h[:0], act=act, beta=4.0, linear_beta=25.0)
            res[f"glu-{str(dtype)[6:]}-{act}"] = {"rel": _rel(got, want), "dtype_ok": got.dtype == want.dtype,
                                                  "empty_ok": tuple(empty.shape) == (0, 48)}
    return res


def _moe_out_cases() -> dict:
    """The latent MoE's output projection (its input kernel, then the GEMM) against the reference: fp32 and fp16,
    with and without the latent norm, a rank's column slice that starts inside the latent and is not a power of
    two wide, strided gate | up rows (a column slice of the in_proj output, as the graph passes them), no rows."""
    from k3plugins.moe_out import reference as ref
    from k3plugins.moe_out import triton as mo
    g = torch.Generator().manual_seed(8)
    res = {}
    for dtype in (torch.float32, torch.float16):
        for norm in (True, False):
            T, dl, start, size, inter, d = 5, 96, 24, 40, 24, 64
            y = torch.randn(T, dl, generator=g) * 3
            nw = (1 + 0.1 * torch.randn(dl, generator=g)).to(dtype) if norm else None
            wide = (torch.randn(T, dl + 2 * inter, generator=g) * 4).to(dtype)
            h = wide[:, dl:]                                                      # row stride dl + 2I
            w = (torch.randn(d, size + inter, generator=g) * 0.1).to(dtype)
            kw = dict(start=start, size=size, eps=1e-5, act="situ", beta=4.0, linear_beta=25.0)
            got, want = mo.moe_out_proj(y, nw, h, w, **kw), ref.moe_out_proj(y, nw, h, w, **kw)
            x_got, x_want = mo.gemm_input(y, nw, h, **kw), ref.gemm_input(y, nw, h, **kw)
            empty = mo.moe_out_proj(y[:0], nw, h[:0], w, **kw)
            res[f"moe-out-{str(dtype)[6:]}-{norm}"] = {"rel": _rel(got, want), "rel_input": _rel(x_got, x_want),
                                                       "dtype_ok": got.dtype == want.dtype,
                                                       "empty_ok": tuple(empty.shape) == (0, d)}
    return res


def _router_cases() -> dict:
    """The fused router (logits split over K, top-k by tl.topk on packed keys) against the reference: fp16, E not
    a power of two, ragged M, with and without bias and renormalisation, and a forced tie (two experts with the
    same gate row and bias: picked together or not at all); the logits kernel in both MMA orientations (SWAP)."""
    from k3plugins.router import reference as ref
    from k3plugins.router import triton as router
    g = torch.Generator().manual_seed(7)
    res = {}
    for M, E, k, bias, renorm in ((5, 96, 8, True, True), (17, 64, 4, False, False), (1, 40, 16, True, True)):
        x = torch.randn(M, 256, generator=g).to(torch.float16)
        w = (torch.randn(E, 256, generator=g) * 256 ** -0.5).to(torch.float16)
        w[E - 1] = w[3]                                                       # experts 3 and E-1 always tie
        b = torch.randn(E, generator=g) * 0.1 if bias else None
        if bias:
            b[E - 1] = b[3]
        kw = dict(top_k=k, renormalize=renorm, scaling_factor=2.5)
        ids, wts = router.route(x, w, b, **kw)
        ids_r, wts_r = ref.route(x, w, b, **kw)
        # the picks as sets (torch.topk orders ties as it likes), each weight with its expert
        (ids, o), (ids_r, o_r) = ids.sort(1), ids_r.sort(1)
        ids_s, wts_s = router.route(x, w, b, **kw, blocks=router.LogitBlocks(16, 32, 64, 3, swap=True))
        res[f"router-{M}-{E}-{k}"] = {"ids_equal": bool(torch.equal(ids, ids_r)),
                                       "rel": _rel(wts.gather(1, o), wts_r.gather(1, o_r)),
                                       "tie_picked_together": bool(((ids == 3).any(1) == (ids == E - 1).any(1)).all()),
                                       "swap_ids_equal": bool(torch.equal(ids_s.sort(1)[0], ids)),
                                       "swap_rel": _rel(wts_s.sort(1)[0], wts.sort(1)[0])}
    return res


def _moe_in_cases() -> dict:
    """MoEInProj's top-k launch with its cast (the rest of each fp32 row to the activation dtype) against the
    reference: fp32 and fp16, E not a power of two, a row wider than one cast block (and a row a program), no
    tokens. On the CPU the GEMM is the reference's own fp32 matmul; the cuBLAS fp32-out GEMM is tested on the GPU
    (test_moe_in_gpu.py)."""
    from k3plugins.moe_in import reference as ref
    from k3plugins.moe_in import triton as mi
    from k3plugins.router import triton as router
    g = torch.Generator().manual_seed(9)
    res = {}
    for dtype in (torch.float32, torch.float16):
        T, D, N, E = 6, 64, 1100, 40
        x = torch.randn(T, D, generator=g).to(dtype)
        w = (torch.randn(N + E, D, generator=g) * D ** -0.5).to(dtype)
        b = torch.randn(E, generator=g) * 0.1
        kw = dict(num_experts=E, top_k=8, renormalize=True, scaling_factor=2.5)
        ids, wts, zh = mi.moe_in_proj(x, w, b, **kw)
        ids_r, wts_r, zh_r = ref.moe_in_proj(x, w, b, **kw)
        (ids, o), (ids_r, o_r) = ids.sort(1), ids_r.sort(1)
        empty = mi.moe_in_proj(x[:0], w, b, **kw)
        split_max, router.CAST_SPLIT_MAX_TOKENS = router.CAST_SPLIT_MAX_TOKENS, 0  # a whole row a cast program
        try:
            zh_rows = mi.moe_in_proj(x, w, b, **kw)[2]
        finally:
            router.CAST_SPLIT_MAX_TOKENS = split_max
        res[f"moe-in-{str(dtype)[6:]}"] = {"ids_equal": bool(torch.equal(ids, ids_r)),
                                           "rel": _rel(wts.gather(1, o), wts_r.gather(1, o_r)),
                                           "zh_equal": bool(torch.equal(zh, zh_r) and torch.equal(zh_rows, zh_r)),
                                           "empty_ok": [tuple(t.shape) for t in empty] == [(0, 8), (0, 8), (0, N)]}
    return res


def _gumbel_argmax_cases() -> dict:
    """The sampler's draw in one launch against its torch ops (k3runtime.sampler): rows of several lengths (one
    chunk, several, a ragged last block), -inf tokens, a row all -inf, ties (logits rounded to halves), more chunks
    than blocks (PROGRAMS small), and the seeds strided as the sampler's are."""
    from k3plugins.sample import triton as st
    from k3runtime.sampler import _draw_seed, gumbel_noise
    g = torch.Generator().manual_seed(11)
    res = {}
    for M, V, programs in ((3, 700, 1024), (5, 5000, 1024), (2, 5000, 4)):
        x = (torch.randn(M, V, generator=g) * 2).round() / 2
        x[0, ::3] = float("-inf")
        x[-1] = float("-inf") if M == 3 else x[-1]
        # the seeds as the sampler passes them: a column of its [M, 3] parameters (stride 3)
        seeds = torch.tensor([[1, 1, _draw_seed(m, 9)] for m in range(M)], dtype=torch.int64)[:, 2]
        want = (x + gumbel_noise(seeds, torch.arange(V))).argmax(dim=-1)
        st.PROGRAMS, old = programs, st.PROGRAMS
        try:
            got = st.gumbel_argmax(x, seeds)
        finally:
            st.PROGRAMS = old
        res[f"gumbel-argmax-{M}-{V}-{programs}"] = {"equal": bool(torch.equal(got, want))}
    return res


def _top_p_cases() -> dict:
    """Top-p's kept set by histograms (k3plugins.sample.top_p) against the sampler's sort, bit for bit: fp32 logits,
    bf16 and coarse ties (ties at the cut keep the lowest ids), -inf tokens (a top-k before it), +0.0 and -0.0 ties;
    top_p at 1 (all), tiny (the best alone), just under 1 and random; rows of 7 to 3000 tokens, one program a row
    or many (PROGRAMS large or small), the later rounds on the rows or on the list of the first round's bucket
    (LIST_MIN_ROWS), the first round in one histogram a row or several (FIRST_COPIES); and a cut at an exact mass
    (the token at it goes, as the sort's >=)."""
    from k3plugins.sample import top_p as tp
    from k3runtime.sampler import top_p_keep
    g = torch.Generator().manual_seed(3)
    res = {}
    # (tokens a row, PROGRAMS, later rounds on the list): one block a program and several, on either path
    configs = [(7, 1024, True), (64, 2, False), (3000, 1024, True), (3000, 2, False), (64, 1024, False),
               (3000, 2, True)]
    for kind in ("fp32", "bf16_ties", "coarse_ties", "masked", "zeros"):
        equal = []
        for trial, (V, programs, listed) in enumerate(configs):
            M = 5
            x = torch.randn(M, V, generator=g) * (0.05 + trial % 6)
            if kind == "bf16_ties":
                x = x.bfloat16().float()
            elif kind == "coarse_ties":
                x = (x * 2).round() / 2
            elif kind == "masked":
                x = x.masked_fill(torch.rand(M, V, generator=g) < 0.7, float("-inf"))
                x[:, trial % V] = 1.0  # a finite token a row
            elif kind == "zeros":
                x = x.clamp(max=0.0)
                x[0], x[1, ::2] = -0.0, -0.0
            top_p = torch.rand(M, generator=g, dtype=torch.float64)
            top_p[:3] = torch.tensor([1.0, 1e-46, 1 - 1e-9], dtype=torch.float64)
            want = x.masked_fill(~top_p_keep(x, top_p), float("-inf"))
            old = tp.PROGRAMS, tp.LIST_MIN_ROWS, tp.FIRST_COPIES
            tp.PROGRAMS, tp.LIST_MIN_ROWS, tp.FIRST_COPIES = programs, 1 if listed else 10**9, trial % 3 + 1
            try:
                got = tp.top_p_filter(x, torch.stack([top_p, top_p], 1)[:, 1])  # a strided column, as the sampler's
            finally:
                tp.PROGRAMS, tp.LIST_MIN_ROWS, tp.FIRST_COPIES = old
            equal.append(torch.equal(got.view(torch.int32), want.view(torch.int32)))
        res[f"top-p-{kind}"] = {"equal": equal}
    # four equal tokens at top_p 0.5 keep the two lowest ids, at 0.75 three; a higher token first keeps only it
    x = torch.zeros(3, 4)
    x[2, 3] = 10.0
    keep = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    got = tp.top_p_filter(x, torch.tensor([0.5, 0.75, 0.5], dtype=torch.float64))
    res["top-p-exact-mass"] = {"equal": [torch.equal(got, x.masked_fill(~keep, float("-inf")))]}
    # the tie weight to the last unit (tests/top_p_rows.py), on both paths
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from top_p_rows import tie_weight_rows
    x, top_p = tie_weight_rows(64)
    want = x.masked_fill(~top_p_keep(x, top_p), float("-inf"))
    equal = [set((want[:, 1:9] > float("-inf")).sum(1).tolist()) == {2, 3}]  # the one step does move the cut
    for listed in (False, True):
        old = tp.LIST_MIN_ROWS
        tp.LIST_MIN_ROWS = 1 if listed else 10**9
        try:
            equal.append(torch.equal(tp.top_p_filter(x, top_p).view(torch.int32), want.view(torch.int32)))
        finally:
            tp.LIST_MIN_ROWS = old
    res["top-p-tie-weight"] = {"equal": equal}
    return res


def _child(part: str) -> None:
    """The checks of one part ("norms": RMSNorm, AttnRes, top-p and the un-absorbed MLA prefill, about 110 s here;
    "kernels": the others, about 90 s), printed as one JSON line."""
    _patch_interpreter()
    if part == "norms":
        from k3plugins.mla import triton as mla
        print("RESULTS " + json.dumps({**_norm_cases(), **_top_p_cases(), **_mla_unabsorbed_cases(mla)}))
        return
    from k3plugins.kda import fla as kd
    from k3plugins.mla import triton as mla
    from k3plugins.moe import triton as moe
    from k3plugins.moe.mxfp4 import dequantize_mxfp4
    res = {}
    for dtype in (torch.float32, torch.float16):
        for act in ("situ", "silu"):
            res[f"moe-{str(dtype)[6:]}-{act}"] = _moe_case(moe, dtype, act)
    res["moe-entry"] = _moe_case(moe, torch.float32, "situ", entry=moe.moe_experts_w4)
    for dtype in (torch.float32, torch.float16):
        res[f"moe-strided-{str(dtype)[6:]}"] = _moe_strided_case(moe, dtype)
        res[f"moe-paired-{str(dtype)[6:]}"] = _moe_strided_case(moe, dtype, paired=True)
    res["moe-tiled-float32"] = _moe_strided_case(moe, torch.float32, tiled=True)
    res["moe-tiled-half-float32"] = _moe_strided_case(moe, torch.float32, tiled=True, block_n=32)
    res["moe-rows-first-float32"] = _moe_strided_case(moe, torch.float32, paired=True, rows_first=True)
    res["moe-overlap-float32"] = _moe_strided_case(moe, torch.float32, tiled=True, block_n=64, rows_first=True,
                                                   overlap=True)
    res["moe-overlap-down128-float32"] = _moe_strided_case(moe, torch.float32, tiled=True, block_n=64, rows_first=True,
                                                           overlap=True, down_block_n=128)
    res["moe-lane-float32"] = _moe_strided_case(moe, torch.float32, tiled=True, block_n=64, rows_first=True,
                                                overlap=True, lane=True)
    res["moe-lane-float16"] = _moe_strided_case(moe, torch.float16, paired=True, lane=True)
    res["moe-lane-y-half-float16"] = _moe_strided_case(moe, torch.float16, tiled=True, block_n=64, rows_first=True,
                                                       overlap=True, lane=True, y_half=True)
    res["moe-lane-gather-float32"] = _moe_strided_case(moe, torch.float32, tiled=True, block_n=64, rows_first=True,
                                                       overlap=True, lane=True, gather_combine=True)
    res["combine-k3"] = _combine_case(moe, 3)
    res["combine-k16"] = _combine_case(moe, 16)
    res["sort-pairs"] = _sort_pairs_case(moe)
    res["sort-pairs-one-block"] = _sort_pairs_case(moe, max_block=2048)
    res["sort-pairs-flat"] = _sort_pairs_case(moe, cols=1)
    res["sort-pairs-one-block-flat"] = _sort_pairs_case(moe, max_block=2048, cols=1)
    res["sort-pairs-one-block-cols16"] = _sort_pairs_case(moe, max_block=2048, cols=16)
    res["sort-pairs-cols16"] = _sort_pairs_case(moe, cols=16)
    res["sort-pairs-one-row-blocks"] = _sort_pairs_case(moe, max_block=16, cols=16, tokens=11)  # BLOCK == COLS
    g = torch.Generator().manual_seed(1)
    w = torch.randint(0, 256, (2, 64, 128), dtype=torch.uint8, generator=g)
    s = torch.randint(100, 129, (2, 64, 8), dtype=torch.uint8, generator=g)  # the W4 decode's exact range
    res["dequant"] = {"equal": bool(torch.equal(moe.dequantize(w, s, torch.float32), dequantize_mxfp4(w, s)))}
    for splits in (1, 2, 4):
        res[f"mla-{splits}"] = _mla_case(mla, splits)
        res[f"mla-{splits}-exchange"] = _mla_case(mla, splits, exchange=True)
    mla.MAX_GRID_ROWS, launch = 2, mla._launch_triton  # 3 query rows in two launches (CUDA's 65535 in the engine)
    for splits in (1, 2):
        rows = []
        mla._launch_triton = lambda *a, rows=rows: (rows.append(a[0].shape[0]), launch(*a))[1]
        res[f"mla-row-slices-{splits}"] = {**_mla_case(mla, splits), "launch_rows": rows}
    mla.MAX_GRID_ROWS, mla._launch_triton = 65535, launch
    res["mla-mixer"] = _mla_mixer_case(mla)
    res["mla-mixer-host-seqs"] = _mla_mixer_case(mla, host_seqs=True)  # every sequence under MIN_NEW_TOKENS
    res["mla-mixer-nan-tails"] = _mla_mixer_case(mla, poison=((1, 1), (7, 3)))
    for pieces in (False, True):
        res[f"mha-prefill-fp16-out-{pieces}"] = _mha_prefill_out_dtype_case(pieces)
    res["mla-cache-write"] = _mla_cache_write_case(mla)
    for lb in (-5.0, None):
        for tactic in ("fused", "fused-f-b-gemm", "split", "split-wide"):
            res[f"kda-decode-{lb}-{tactic}"] = _kda_decode_case(kd, lb, tactic)
    res["kda-conv-prefill"] = _kda_conv_prefill_case(kd)
    res["kda-conv-prefill-norm"] = _kda_conv_prefill_case(kd, norm_k=8)  # two heads a tile of 16 channels
    res["kda-conv-prefill-tail"] = _kda_conv_prefill_case(kd, norm_k=8, lens=(1, 17))
    res.update(_glu_cases())
    res.update(_router_cases())
    res.update(_moe_in_cases())
    res.update(_moe_out_cases())
    res.update(_gumbel_argmax_cases())
    print("RESULTS " + json.dumps(res))


@pytest.fixture(scope="module")
def results():
    """Both parts' checks, run at once in two children (one thread each: the suite's machine has two cores)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, part], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for part in ("kernels", "norms")]
    res = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            line = next((ln for ln in out.splitlines() if ln.startswith("RESULTS ")), None)
            assert proc.returncode == 0 and line, f"interpreter child failed:\n{out[-3000:]}\n{err[-3000:]}"
            res.update(json.loads(line[len("RESULTS "):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return res


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 3e-3)])  # fp16: h rounds between GEMMs
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_interpreted(results, dtype, tol, act):
    r = results[f"moe-{dtype}-{act}"]
    assert r["token0_zero"], "a token with no local expert must get exactly zero"
    assert r["rel"] < tol, r


def test_moe_registry_entry_fits_small_experts(results):
    r = results["moe-entry"]
    assert r["token0_zero"] and r["rel"] < 1e-5, r


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 3e-3)])
@pytest.mark.parametrize("layout", ["strided", "paired"])
def test_moe_strided_layout_interpreted(results, dtype, tol, layout):
    assert results[f"moe-{layout}-{dtype}"]["rel"] < tol, results[f"moe-{layout}-{dtype}"]


@pytest.mark.parametrize("case", ["moe-tiled-float32", "moe-tiled-half-float32"])
def test_moe_tiled_layout_interpreted(results, case):
    assert results[case]["rel"] < 1e-5, results[case]


@pytest.mark.parametrize("case", ["moe-overlap-float32", "moe-overlap-down128-float32"])
def test_moe_overlapped_down_interpreted(results, case):
    assert results[case]["rel"] < 1e-5, results[case]


@pytest.mark.parametrize("case,tol", [("moe-lane-float32", 1e-5), ("moe-lane-float16", 3e-3),
                                      ("moe-lane-y-half-float16", 3e-3)])
def test_moe_lane_layout_interpreted(results, case, tol):
    """lane_mxfp4's layout (K permuted so that each lane loads its own scales), z in its order, against the
    reference on the checkpoint's bytes: overlapped and tiled (fp32), plain paired grid (fp16), and decode_l's
    grid with the per-pair rows in fp16 (y_half)."""
    assert results[case]["rel"] < tol, results[case]


def test_moe_half_pair_rows_interpreted(results):
    """y_half rounds each pair's row to fp16 before the sum: near the fp32-row output, and not equal to it (a y
    left in fp32 would give 0)."""
    r = results["moe-lane-y-half-float16"]
    assert 0 < r["rel_fp32_y"] < 1e-3, r


def test_moe_gather_combine_interpreted(results):
    """The combine gathering a token's rows at once (decode_l_gc's) against the reference, and against the loop's
    combine: the same sums in another order (fp32, so within a few ulps; a combine that dropped or doubled a row
    would be far off)."""
    r = results["moe-lane-gather-float32"]
    assert r["rel"] < 1e-5 and r["rel_loop"] < 1e-6, r


@pytest.mark.parametrize("case", ["combine-k3", "combine-k16"])
def test_moe_combine_interpreted(results, case):
    assert max(results[case].values()) < 1e-6, results[case]


def test_moe_rows_first_grid_interpreted(results):
    assert results["moe-rows-first-float32"]["rel"] < 1e-5, results["moe-rows-first-float32"]


@pytest.mark.parametrize("case", ["sort-pairs", "sort-pairs-one-block", "sort-pairs-flat", "sort-pairs-one-block-flat",
                                  "sort-pairs-one-block-cols16", "sort-pairs-cols16", "sort-pairs-one-row-blocks"])
def test_sort_pairs_interpreted(results, case):
    assert all(results[case].values()), results[case]


def test_mxfp4_dequant_interpreted(results):
    assert results["dequant"]["equal"]


@pytest.mark.parametrize("exchange", [False, True], ids=["", "exchange"])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_mla_decode_interpreted(results, splits, exchange):
    """exchange: the scores through the per-program scratch, two buffers by page parity (a slice of 1-4 pages)."""
    assert results[f"mla-{splits}" + ("-exchange" if exchange else "")]["rel"] < 1e-5


@pytest.mark.parametrize("splits", [1, 2])
def test_mla_decode_over_row_slices_interpreted(results, splits):
    """More query rows than a grid dimension takes: launched in slices, each row's output its own (in place with
    one split, merged per slice with two)."""
    r = results[f"mla-row-slices-{splits}"]
    assert r["rel"] < 1e-5 and r["launch_rows"] == [2, 1], r


def test_mla_cache_write_interpreted(results):
    r = results["mla-cache-write"]
    assert r["rel"] < 1e-6 and r["untouched"] and r["cleared"], r


@pytest.mark.parametrize("case", ["mla-mixer", "mla-mixer-host-seqs", "mla-mixer-nan-tails"])
def test_mla_mixer_interpreted(results, case):
    """nan-tails: the two pages the step begins held NaN past the rows it writes (a page's earlier owner): the
    step clears them before the attention reads the page, so the output is the reference's, and so is the cache."""
    r = results[case]
    assert r["rel"] < 1e-5 and r["cache_rel"] < 1e-6, r


@pytest.mark.parametrize("case", ["one-piece", "pieces", "odd-v", "one-piece-split", "one-piece-shared",
                                  "one-piece-shared-split", "one-piece-shared-odd-v", "pieces-split"])
def test_mla_unabsorbed_prefill_interpreted(results, case):
    """The two prefill sequences (40 and 20 new tokens) in the un-absorbed form, the decode token absorbed: the
    whole step equal to the reference (split: the keys every row of a block sees first, unmasked). shared
    (SHARED_LAUNCH) with one piece: both in one launch (mha_prefill_varlen); else, and in pieces, each alone."""
    r = results[f"mla-unabsorbed-{case}"]
    assert r["rel"] < 1e-5 and r["cache_rel"] < 1e-6 and r["calls"] == [40, 20], r
    assert r["varlen"] == ([[40, 20]] if case.startswith("one-piece-shared") else []), r


@pytest.mark.parametrize("case", ["together", "together-too-few"])
def test_mla_prompts_together_interpreted(results, case):
    """At the engine's own thresholds, four prompts of 128, 64, 192 and 128 new tokens beside a decode token take
    the un-absorbed form in one launch (prefill.TOGETHER_LEAST: four, 512 new tokens between them); with 127 for
    the last, none does (511): the whole step equal to the reference either way."""
    r = results[f"mla-unabsorbed-{case}"]
    taken = [128, 64, 192, 128] if case == "together" else []
    assert r["rel"] < 1e-5 and r["cache_rel"] < 1e-6 and r["calls"] == taken, r
    assert r["varlen"] == ([taken] if taken else []), r


@pytest.mark.parametrize("pieces", [False, True], ids=["one-piece", "pieces"])
def test_mha_prefill_writes_out_dtype_interpreted(results, pieces):
    """The un-absorbed kernel's last piece stores into the caller's fp16 rows directly (no fp32 copy): the same
    values as into fp32, up to fp16's rounding, and nothing outside the rows written."""
    r = results[f"mha-prefill-fp16-out-{pieces}"]
    assert r["rel"] < 2e-3 and r["around_kept"], r


@pytest.mark.parametrize("tactic", ["fused", "fused-f-b-gemm", "split", "split-wide"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe_gate", "softplus"])
def test_kda_decode_interpreted(results, lower_bound, tactic):
    r = results[f"kda-decode-{lower_bound}-{tactic}"]
    assert r["rel"] < 1e-5 and r["state_rel"] < 1e-5 and r["conv_equal"], r
    assert r["f_b_inside"] == (tactic == "fused"), r  # the small grid takes f_b inside, unless told otherwise


@pytest.mark.parametrize("case", ["kda-conv-prefill", "kda-conv-prefill-norm", "kda-conv-prefill-tail"])
def test_kda_conv_prefill_interpreted(results, case):
    r = results[case]
    assert r["rel"] < 1e-6 and r["state_equal"], r


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 1e-3)])  # fp16: rounding of the output
def test_rms_norm_interpreted(results, dtype, tol):
    r = results[f"rmsnorm-{dtype}"]
    assert r["dtype_ok"] and r["shape_ok"] and r["rel"] < tol, r


@pytest.mark.parametrize("k", [0, 1, 5, 8, 11])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 1e-3)])
def test_attn_res_interpreted(results, dtype, tol, k):
    """Snapshots stacked [K, M, D] or as K tensors read in place (the executor's form), up to the kernel's 8
    pointers and past them."""
    r = results[f"attnres-{dtype}-{k}"]
    assert r["dtype_ok"] and r["rel"] < tol and r["rel_list"] < tol, r
    assert r["rel_split"] < tol and r["rel_split_masked"] < tol, r  # the split tactic, over 3 and 4 chunks
    assert r["rel_delta"] < tol and r["sum_exact"], r  # the residual add fused, in both forms


@pytest.mark.parametrize("k", [0, 1, 5, 8, 11])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 1e-3)])
def test_attn_res_out_norm_interpreted(results, dtype, tol, k):
    """The next RMSNorm fused (out_norm), one program a token and split, with and without the residual add."""
    r = results[f"attnres-norm-{dtype}-{k}"]
    assert r["dtype_ok"] and r["rel"] < tol and r["rel_delta"] < tol and r["sum_exact"], r
    assert r["unfused_exact"], r  # the mix stored, then the RMSNorm kernel: the same values


@pytest.mark.parametrize("case", ["5-96-8", "17-64-4", "1-40-16"])
def test_router_interpreted(results, case):
    r = results[f"router-{case}"]
    assert r["ids_equal"] and r["tie_picked_together"] and r["rel"] < 1e-5, r
    assert r["swap_ids_equal"] and r["swap_rel"] < 1e-5, r


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_moe_in_proj_interpreted(results, dtype):
    r = results[f"moe-in-{dtype}"]
    assert r["ids_equal"] and r["rel"] < 1e-5 and r["zh_equal"] and r["empty_ok"], r


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 1e-3)])
def test_glu_interpreted(results, dtype, tol, act):
    r = results[f"glu-{dtype}-{act}"]
    assert r["dtype_ok"] and r["empty_ok"] and r["rel"] < tol, r


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 2e-3)])  # fp16: the input's rounding
def test_moe_out_proj_interpreted(results, dtype, tol, norm):
    r = results[f"moe-out-{dtype}-{norm}"]
    assert r["dtype_ok"] and r["empty_ok"] and r["rel_input"] < tol and r["rel"] < tol, r


@pytest.mark.parametrize("case", ["3-700-1024", "5-5000-1024", "2-5000-4"])
def test_gumbel_argmax_interpreted(results, case):
    assert results[f"gumbel-argmax-{case}"]["equal"]


@pytest.mark.parametrize("case", ["fp32", "bf16_ties", "coarse_ties", "masked", "zeros", "exact-mass", "tie-weight"])
def test_top_p_by_histograms_interpreted(results, case):
    assert all(results[f"top-p-{case}"]["equal"]), results[f"top-p-{case}"]


if __name__ == "__main__":
    _child(sys.argv[1])
