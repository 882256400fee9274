"""MLA paged decode: Triton split-K vs torch bmm (absorbed, contiguous cache) and the KV-bytes floor."""

from __future__ import annotations

import os
from unittest import mock

import torch

from common import emit, mma_tflops, rel_l2, time_ms
from k3plugins.mla.triton import PAGE, mla_decode_attention

SCALE = 192 ** -0.5
# absorbed MLA's FLOPs a head and cached token: scores over the 576-wide row, values over its 512 latent columns
FLOPS_PER_HEAD_TOKEN = 2 * (576 + 512)
# prefill chunks (cached, new tokens, heads): long after a long context, a fresh prompt's, a short one, at TP's 16 heads
PREFILL_CASES = ((8192, 2048, 96), (0, 512, 96), (2048, 256, 96), (8192, 2048, 16))
# several sequences' chunks in one step (sequences, cached, new tokens, heads): a TP16 rank's 6 heads, TP6's 16, 96;
# 128 new tokens after 2048 at 6 and 16 heads: min_new_tokens' edge there, placed by one sequence's rows alone
PREFILL_MANY_CASES = ((8, 2048, 128, 6), (8, 2048, 192, 6), (4, 8192, 512, 6), (8, 2048, 128, 16),
                      (8, 2048, 256, 16), (8, 0, 256, 96), (4, 512, 512, 96))
# the rows that placed prefill.TOGETHER_* (fifty-third session): one to 32 sequences of 32 to 192 new tokens, fresh
# or after 512 to 8192 cached, at 6, 16, 48 and 96 heads
PREFILL_TOGETHER_CASES = (
    *((1, 0, chunk, H) for H in (6, 16, 48, 96) for chunk in (32, 64, 128, 192)),
    (8, 0, 32, 6), (8, 0, 64, 6), (8, 0, 128, 6), (32, 0, 128, 6), (4, 0, 128, 6), (2, 0, 128, 6), (2, 0, 64, 6),
    (8, 0, 128, 16), (32, 0, 64, 16), (4, 0, 128, 48), (8, 0, 128, 48),
    (8, 0, 32, 96), (8, 0, 64, 96), (8, 0, 128, 96), (32, 0, 128, 96), (8, 0, 192, 96), (2, 0, 192, 96),
    (2, 0, 64, 96), (2, 0, 32, 96),
    (8, 512, 128, 6), (1, 512, 64, 6), (8, 512, 128, 96), (2, 512, 64, 96), (1, 512, 128, 96),
    (8, 1024, 64, 6), (2, 1024, 64, 6), (1, 1024, 128, 6), (2, 1024, 128, 48), (8, 1024, 64, 96),
    (8, 1024, 128, 96), (1, 1024, 192, 96), (4, 1024, 192, 96),
    (8, 2048, 32, 6), (8, 2048, 64, 6), (2, 2048, 64, 6), (2, 2048, 128, 6), (8, 2048, 64, 16), (4, 2048, 64, 16),
    (8, 2048, 64, 48), (8, 2048, 128, 48), (8, 2048, 128, 96), (8, 2048, 192, 96), (4, 2048, 128, 96),
    (4, 2048, 192, 96), (2, 2048, 192, 96), (16, 2048, 64, 96), (8, 8192, 64, 6), (8, 8192, 128, 96))

# fresh prompts taken together beside a step's decode rows (prompts, new tokens, heads, decode rows, their context)
PREFILL_BESIDE_DECODE_CASES = tuple((n, chunk, H, decode, ctx) for H in (6, 96) for n, chunk in ((4, 128), (8, 64),
                                    (32, 128)) for decode, ctx in ((32, 2048), (128, 8192)))


def prefill_inputs(gen: torch.Generator, num_pages: int, rows: int, H: int, nope: int = 128, vd: int = 128):
    """A prefill's tensors on the GPU, bf16: the cache's pages [num_pages, PAGE, 576], `rows` queries [rows, H,
    nope + 64], w_uk [H, nope, 512] and w_uv [H, 512, vd]."""
    kv = torch.randn(num_pages, PAGE, 576, device="cuda", generator=gen).to(torch.bfloat16)
    q = torch.randn(rows, H, nope + 64, device="cuda", generator=gen).to(torch.bfloat16)
    w_uk = (torch.randn(H, nope, 512, device="cuda", generator=gen) * nope ** -0.5).to(torch.bfloat16)
    w_uv = (torch.randn(H, 512, vd, device="cuda", generator=gen) * 512 ** -0.5).to(torch.bfloat16)
    return kv, q, w_uk, w_uv


def absorbed_prefill(q, kv, pt, lens, rows, w_uk, w_uv, kernel: str) -> torch.Tensor:
    """Prefill queries [T, H, nope + 64] in the absorbed form, as the mixer runs them: q_nope·w_uk, the decode
    kernel over each row's sequence (page-table row `rows`, `lens` keys), o_lat·w_uv. Returns [T, H, v]."""
    nope = w_uk.shape[1]
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)
    o_lat = mla_decode_attention(q_lat, q[..., nope:], kv, pt, lens, scale=SCALE, query_seq=rows, kernel=kernel)
    return torch.bmm(o_lat.transpose(0, 1), w_uv).transpose(0, 1)


def fastest_absorbed_kernel() -> str:
    """The mixer's decode kernel on this GPU: Gluon on sm_90, else Triton."""
    return "gluon" if torch.cuda.get_device_capability()[0] == 9 else "triton"


def make_case(B: int, L: int, H: int, gen: torch.Generator):
    pages = B * L // PAGE
    kv = torch.randn(pages, PAGE, 576, device="cuda", generator=gen).to(torch.bfloat16)
    pt = torch.randperm(pages, device="cuda", generator=gen).view(B, L // PAGE).to(torch.int32)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    ql = torch.randn(B, H, 512, device="cuda", generator=gen).to(torch.bfloat16)
    qp = torch.randn(B, H, 64, device="cuda", generator=gen).to(torch.bfloat16)
    return kv, pt, lens, ql, qp


def bmm_baseline(kv, pt, ql, qp):
    B, H, _ = ql.shape
    cache = kv[pt.long()].view(B, -1, 576)       # contiguous per sequence: the baseline gets it for free
    q = torch.cat([ql, qp], -1)

    def run():
        s = torch.bmm(q, cache.transpose(1, 2)).float() * SCALE
        return torch.bmm(torch.softmax(s, -1).to(cache.dtype), cache[:, :, :512])
    return run, cache


def _with_knobs(fn, **knobs):
    """fn run with gluon_sm90's module knobs set (NARROW_REMAINDER, LEAN_SOFTMAX: read at launch, so the CUDA graph
    captures the variant's kernels)."""
    from k3plugins.mla import gluon_sm90

    def run():
        with mock.patch.multiple(gluon_sm90, **knobs):
            return fn()
    return run


# the Gluon kernel's variants the bench sets side by side with its default ("gluon"): name -> knobs
GLUON_VARIANTS = {"gluon_narrow": dict(NARROW_REMAINDER=True), "gluon_masked": dict(LEAN_SOFTMAX=False)}


def _ragged_check(gen: torch.Generator) -> None:
    """The host's kernel on ragged lengths 1..4096 (one sequence of a single token) against the fp32 definition."""
    kv, pt, _, ql, qp = make_case(4, 4096, 96, gen)
    lens = torch.tensor([1, 63, 1000, 4096], dtype=torch.int32, device="cuda")
    out = mla_decode_attention(ql, qp, kv, pt, lens, scale=SCALE)
    refs = []
    for b in range(4):
        toks = kv[pt[b].long()].view(-1, 576)[: int(lens[b])].float()
        s = (ql[b].float() @ toks[:, :512].T + qp[b].float() @ toks[:, 512:].T) * SCALE
        refs.append(torch.softmax(s, -1) @ toks[:, :512])
    emit(bench="mla_check", rel_l2=rel_l2(out.float(), torch.stack(refs)))
    del kv


def bench_mla(bw_tbps: float, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    # K3_BENCH_MLA_QUICK=1: the 96-head cases' Gluon kernels alone, beside the floors and bmm (device time short)
    quick = os.environ.get("K3_BENCH_MLA_QUICK") == "1"
    if not quick:
        _ragged_check(gen)
    # the math floor beside the bytes': absorbed MLA does 2·(576 + 512) FLOPs a head and cached token against 1152
    # bytes, so at 96 heads its FLOPs at the dense bf16 rate take most of its bytes' time at the HBM rate (on an
    # H200 about 0.8-0.9 of it): what a kernel can reach of the KV floor is capped by its tensor-core efficiency
    tflops = mma_tflops()
    emit(bench="mla_mma_rate", mma_tflops=round(tflops, 1), flop_per_kv_byte=round(FLOPS_PER_HEAD_TOKEN / 1152, 3),
         ridge_flop_per_byte=round(tflops / bw_tbps, 1))
    cases = ((64, 8192, 96), (32, 65536, 96)) if quick else ((64, 8192, 16), (32, 65536, 16), (64, 8192, 96),
                                                              (32, 65536, 96))
    for B, L, H in cases:
        kv, pt, lens, ql, qp = make_case(B, L, H, gen)
        floor_ms = B * L * 576 * 2 / (bw_tbps * 1e12) * 1e3
        flops = B * L * H * FLOPS_PER_HEAD_TOKEN  # exact heads; a 64-head block pads 96 to 128
        math_ms = flops / (tflops * 1e12) * 1e3
        base, cache = bmm_baseline(kv, pt, ql, qp)
        t_base = time_ms(base, rep=10)
        ref = base().float()
        del cache
        # the host's split count (num_splits_for: about one wave of programs; 4 at 64 x 8K and 8 at 32 x 64K with
        # 16 heads, 2 / 4 with 96) beside fewer and beside two waves' (8 / 16, and 4 / 8), which write and merge more
        # partial outputs (fp32 [B, splits, H, 512]: 16.8 MB at 8 splits, about 3 % of the KV bytes)
        # (block_h, splits, warps, stages, exchange): exchange sends the scores through an L2 scratch so that each
        # warpgroup computes its share of them (64-head blocks of 8 warps: the host's default on CUDA)
        configs = ([(16, None, 4, 2, False), (16, 2, 4, 2, False), (16, 8, 4, 2, False), (16, 16, 4, 2, False)]
                   if H == 16 else
                   [(32, None, 4, 2, False), (64, None, 8, 2, False), (64, 4, 8, 2, False), (64, 8, 8, 2, False),
                    (64, None, 8, 2, True), (64, 4, 8, 2, True)])
        if sweep:
            configs += ([(16, None, 4, 1, False), (16, None, 4, 3, False), (16, None, 8, 2, False)] if H == 16 else
                        [(32, None, 8, 2, False), (32, None, 4, 1, False), (32, None, 4, 3, False),
                         (64, None, 8, 1, False), (16, None, 2, 2, False), (64, 8, 8, 2, True), (64, None, 16, 2, True)])
        # the sm_90 Gluon kernel (64-head blocks, TMA pages, warp-specialized): its split counts
        runs = [] if quick else [(c, "triton") for c in configs]
        if H >= 64 and torch.cuda.get_device_capability()[0] == 9:
            runs += [((64, ns, 4, 2, False), "gluon") for ns in (None, 1, 2, 4)]
            # the softmax before LEAN_SOFTMAX (the mask on every page, the scale by multiplies of its own)
            runs += [((64, ns, 4, 2, False), "gluon_masked") for ns in (None, 1, 2)]
            if H % 64:  # the last head block on the MMA's N (gluon_sm90.NARROW_REMAINDER)
                runs += [((64, ns, 4, 2, False), "gluon_narrow") for ns in (None, 2, 4)]
        best = None
        for (bh, ns, nw, st, xc), kern in runs:
            fn = lambda bh=bh, ns=ns, nw=nw, st=st, xc=xc, kern=kern: mla_decode_attention(
                ql, qp, kv, pt, lens, scale=SCALE, num_splits=ns, block_h=bh, num_warps=nw, num_stages=st,
                exchange=xc, kernel="gluon" if kern in GLUON_VARIANTS else kern)
            if kern in GLUON_VARIANTS:
                fn = _with_knobs(fn, **GLUON_VARIANTS[kern])
            try:
                t = time_ms(fn, rep=10)
                err = rel_l2(fn().float(), ref)
            except Exception as exc:
                emit(bench="mla_config_failed", kernel=kern, block_h=bh, num_splits=ns, num_warps=nw,
                     error=repr(exc)[:300])
                continue
            emit(bench="mla_config", B=B, L=L, H=H, kernel=kern, block_h=bh, num_splits=ns, num_warps=nw,
                 num_stages=st, exchange=xc, ms=round(t, 4),
                 frac_of_floor=round(floor_ms / t, 3), rel_l2_vs_bmm=err)
            if best is None or t < best[1]:
                best = ((kern, bh, ns, nw, st, xc), t)
        emit(bench="mla", B=B, L=L, H=H, kv_bytes=B * L * 1152, floor_ms=round(floor_ms, 4),
             bmm_ms=round(t_base, 4), bmm_x_floor=round(t_base / floor_ms, 2), best_config=list(best[0]),
             best_ms=round(best[1], 4), frac_of_floor=round(floor_ms / best[1], 3),
             speedup_vs_bmm=round(t_base / best[1], 2), math_floor_ms=round(math_ms, 4),
             math_x_kv_floor=round(math_ms / floor_ms, 3), tflops=round(flops / best[1] / 1e9, 1),
             frac_of_roofline=round(max(floor_ms, math_ms) / best[1], 3))
        del kv
        torch.cuda.empty_cache()
    if not quick:
        for cached, chunk, H in PREFILL_CASES:
            bench_mla_prefill(tflops, gen, cached=cached, chunk=chunk, H=H)
        for n, cached, chunk, H in PREFILL_MANY_CASES:
            bench_mla_prefill_many(gen, n, cached, chunk, H)


def bench_mla_prefill(tflops: float, gen: torch.Generator, cached: int = 8192, chunk: int = 2048,
                      H: int = 96) -> None:
    """A prefill chunk against its cached pages, as the mixer runs one: `chunk` new tokens of one sequence after
    `cached`. Absorbed (the decode kernel, each token a query row over the sequence's pages up to its own
    position; the q_lat and w_uv bmms around it included) against the un-absorbed form (prefill.mha_prefill: keys
    and values up-projected, flash attention). The work is math (each page serves every later token: the bytes
    stay in L2), so each form's floor is its own FLOPs at the run's dense bf16 rate; the baseline is the portable
    Triton kernel on the same rows."""
    from k3plugins.mla import prefill
    total = cached + chunk
    pages = total // PAGE
    nope, vd = 128, 128
    kv, q, w_uk, w_uv = prefill_inputs(gen, pages, chunk, H, nope, vd)
    pt = torch.randperm(pages, device="cuda", generator=gen).view(1, pages).to(torch.int32)
    lens = torch.arange(cached + 1, total + 1, dtype=torch.int32, device="cuda")  # causal: up to its own position
    rows = torch.zeros(chunk, dtype=torch.int32, device="cuda")  # every row reads the sequence's page-table row
    pairs = lens.sum().item()
    flops = FLOPS_PER_HEAD_TOKEN * H * pairs  # the attention kernel's
    glue = 2 * H * chunk * 512 * (nope + vd)  # q_nope·w_uk and o_lat·w_uv
    flops_mha = 2 * H * pairs * (nope + 64 + vd) + 2 * H * total * 512 * (nope + vd)
    ms_of = lambda f: f / (tflops * 1e12) * 1e3  # noqa: E731
    kernels = ["triton"] + (["gluon"] if torch.cuda.get_device_capability()[0] == 9 else [])
    times, outs = {}, {}

    absorbed = lambda kern: absorbed_prefill(q, kv, pt, lens, rows, w_uk, w_uv, kern)  # noqa: E731

    for kern in kernels:
        times[kern] = time_ms(lambda kern=kern: absorbed(kern), rep=5)
        outs[kern] = absorbed(kern).float()
    best = min(times, key=times.get)
    out = torch.empty(chunk, H, vd, dtype=torch.bfloat16, device="cuda")
    mha = lambda: prefill.mha_prefill(q, kv, pt[0], total, w_uk, w_uv, scale=SCALE, out=out)  # noqa: E731
    times["unabsorbed"] = time_ms(mha, rep=5)
    mha()
    emit(bench="mla_prefill", H=H, cached=cached, chunk=chunk, math_floor_ms=round(ms_of(flops + glue), 4),
         **{f"{k}_ms": round(t, 4) for k, t in times.items()}, best_absorbed=best,
         frac_of_math_floor=round(ms_of(flops + glue) / times[best], 3),
         tflops=round((flops + glue) / times[best] / 1e9, 1),
         speedup_vs_triton=round(times["triton"] / times[best], 2),
         rel_l2_vs_triton=rel_l2(outs[best], outs["triton"]),
         unabsorbed_math_floor_ms=round(ms_of(flops_mha), 4),
         unabsorbed_frac_of_math_floor=round(ms_of(flops_mha) / times["unabsorbed"], 3),
         unabsorbed_tflops=round(flops_mha / times["unabsorbed"] / 1e9, 1),
         unabsorbed_speedup_vs_best_absorbed=round(times[best] / times["unabsorbed"], 2),
         unabsorbed_rel_l2_vs_best_absorbed=rel_l2(out.float(), outs[best]))
    del kv
    torch.cuda.empty_cache()


def bench_mla_prefill_many(gen: torch.Generator, n: int, cached: int, chunk: int, H: int) -> None:
    """n sequences' prefill chunks in one step (`chunk` new tokens after `cached` each), in the un-absorbed form:
    one mha_prefill launch a sequence (the mixer's before) against prefill.attend_sequences (sequences whose
    contexts fit a piece together in one mha_prefill_varlen launch), and the absorbed kernel over all their rows.
    Timed eagerly (an un-absorbed step runs eagerly: its launches count) and from a CUDA graph (the GPU's time
    alone); the varlen layout made once, as a step's first MLA layer makes it for the others."""
    from k3plugins.mla import prefill
    from k3plugins.step_scope import step_scope
    total = cached + chunk
    per = -(-total // PAGE)
    nope, vd = 128, 128
    kv, q, w_uk, w_uv = prefill_inputs(gen, n * per, n * chunk, H, nope, vd)
    pt = torch.randperm(n * per, device="cuda", generator=gen).view(n, per).to(torch.int32)
    picked = [(i, i * chunk, (i + 1) * chunk, total) for i in range(n)]
    outs = {k: torch.empty(n * chunk, H, vd, dtype=torch.bfloat16, device="cuda") for k in ("loop", "varlen")}

    def loop():
        for i, start, end, context in picked:
            prefill.mha_prefill(q[start:end], kv, pt[i], context, w_uk, w_uv, scale=SCALE, out=outs["loop"][start:end])

    def varlen():
        shared, prefill.SHARED_LAUNCH = prefill.SHARED_LAUNCH, True
        try:
            prefill.attend_sequences(q, kv, pt, picked, w_uk, w_uv, scale=SCALE, out=outs["varlen"])
        finally:
            prefill.SHARED_LAUNCH = shared

    lens = (torch.arange(chunk, device="cuda", dtype=torch.int32) + cached + 1).repeat(n)
    rows = torch.arange(n, device="cuda", dtype=torch.int32).repeat_interleave(chunk)
    kern = fastest_absorbed_kernel()
    absorbed = lambda: absorbed_prefill(q, kv, pt, lens, rows, w_uk, w_uv, kern)  # noqa: E731

    times = {}
    with step_scope():
        for name, fn in (("loop", loop), ("varlen", varlen), ("absorbed", absorbed)):
            times[f"{name}_eager_ms"] = time_ms(fn, rep=10, graph=False)
            times[f"{name}_graph_ms"] = time_ms(fn, rep=10)
    groups = len(prefill.launch_groups(picked, PAGE, prefill.key_piece(H, nope, vd, 2)))
    emit(bench="mla_prefill_many", H=H, seqs=n, cached=cached, chunk=chunk, launches=groups,
         **{k: round(t, 4) for k, t in times.items()},
         varlen_speedup_eager=round(times["loop_eager_ms"] / times["varlen_eager_ms"], 2),
         varlen_speedup_graph=round(times["loop_graph_ms"] / times["varlen_graph_ms"], 2),
         varlen_vs_absorbed_eager=round(times["absorbed_eager_ms"] / times["varlen_eager_ms"], 2),
         rel_l2_varlen_vs_loop=rel_l2(outs["varlen"].float(), outs["loop"].float()),
         rel_l2_varlen_vs_absorbed=rel_l2(outs["varlen"].float(), absorbed().float()))
    del kv
    torch.cuda.empty_cache()


def bench_mla_prefill_beside_decode(gen: torch.Generator, n: int, chunk: int, H: int, decode: int,
                                    decode_context: int) -> None:
    """A step of n fresh prompts of `chunk` tokens (prefill.TOGETHER_*'s case) beside `decode` decode rows of
    `decode_context` tokens: every row in the absorbed kernel (one launch, as without TOGETHER_*) against the decode
    rows absorbed (gathered by prefill.other_rows, as the mixer does) and the prompts in the MHA form together
    (attend_sequences). From CUDA graphs."""
    from k3plugins.mla import prefill
    from k3plugins.step_scope import step_scope
    per_p, per_d = -(-chunk // PAGE), -(-decode_context // PAGE)
    nope, vd, T = 128, 128, n * chunk + decode
    num_pages = n * per_p + decode * per_d
    kv, q, w_uk, w_uv = prefill_inputs(gen, num_pages, T, H, nope, vd)
    perm = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    pt = torch.zeros(n + decode, max(per_p, per_d), dtype=torch.int32, device="cuda")
    pt[:n, :per_p] = perm[:n * per_p].view(n, per_p)
    pt[n:, :per_d] = perm[n * per_p:].view(decode, per_d)
    lens = torch.cat([(torch.arange(chunk, device="cuda", dtype=torch.int32) + 1).repeat(n),
                      torch.full((decode,), decode_context, device="cuda", dtype=torch.int32)])
    seqs = torch.cat([torch.arange(n, device="cuda", dtype=torch.int32).repeat_interleave(chunk),
                      torch.arange(n, n + decode, device="cuda", dtype=torch.int32)])
    picked = [(i, i * chunk, (i + 1) * chunk, chunk) for i in range(n)]
    kern = fastest_absorbed_kernel()

    def absorbed(rows=None):  # None: every row, ungathered (the mixer with no MHA rows)
        if rows is None:
            return absorbed_prefill(q, kv, pt, lens, seqs, w_uk, w_uv, kern)
        return absorbed_prefill(q[rows], kv, pt, lens[rows], seqs[rows], w_uk, w_uv, kern)

    out = torch.empty(T, H, vd, dtype=torch.bfloat16, device="cuda")

    def split():
        out[n * chunk:] = absorbed(prefill.other_rows(picked, T, q.device))
        prefill.attend_sequences(q, kv, pt, picked, w_uk, w_uv, scale=SCALE, out=out)

    with step_scope():
        t_all = time_ms(absorbed, rep=10)
        t_split = time_ms(split, rep=10)
    emit(bench="mla_prefill_beside_decode", H=H, prompts=n, chunk=chunk, decode=decode, decode_context=decode_context,
         all_absorbed_ms=round(t_all, 4), together_ms=round(t_split, 4),
         together_speedup=round(t_all / t_split, 2),
         rel_l2_vs_all_absorbed=rel_l2(out.float(), absorbed().float()))
    del kv
    torch.cuda.empty_cache()
