"""MoE benchmarks: Triton MXFP4 W4A16 vs bf16 torch._grouped_mm and the MXFP4 weight-bytes floor."""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from common import cosine, emit, rel_l2, time_ms
from k3plugins.moe import triton as mt
from k3plugins.moe.reference import moe_experts as moe_ref

E, DL, INTER, TOP_K, E_GLOBAL, E_START = 56, 3584, 3072, 16, 896, 112


def make_weights(gen: torch.Generator):
    dev = "cuda"
    w13 = torch.randint(0, 256, (E, 2 * INTER, DL // 2), dtype=torch.uint8, device=dev, generator=gen)
    s13 = torch.randint(119, 124, (E, 2 * INTER, DL // 32), dtype=torch.uint8, device=dev, generator=gen)
    w2 = torch.randint(0, 256, (E, DL, INTER // 2), dtype=torch.uint8, device=dev, generator=gen)
    s2 = torch.randint(119, 124, (E, DL, INTER // 32), dtype=torch.uint8, device=dev, generator=gen)
    return w13, s13, w2, s2


def laid_out_experts(gen: torch.Generator, tactic) -> tuple[tuple[torch.Tensor, ...], int]:
    """make_weights' experts in `tactic`'s layout (mt.lay_out_experts), and the bytes one of them holds
    (expert_bytes): what a probe of one tactic sets up."""
    w13, s13, w2, s2 = make_weights(gen)
    return mt.lay_out_experts(tactic, w13, s13, w2, s2), expert_bytes(w13, s13, w2, s2)


def expert_bytes(w13, s13, w2, s2) -> int:
    """Bytes one expert's MXFP4 codes and scales hold (uint8: an element a byte): the weight floor of a call is this
    times the experts it reads."""
    return sum(t[0].numel() for t in (w13, s13, w2, s2))


def make_tokens(tpe: int, gen: torch.Generator, touched: int = E):
    """tpe tokens on each of the first `touched` local experts (all of them by default): slot 0 local, the other
    15 slots on other ranks' experts."""
    M = touched * tpe
    z = torch.randn(M, DL, device="cuda", generator=gen).to(torch.bfloat16)
    local = (torch.arange(M, device="cuda") % touched) + E_START
    others = torch.randint(0, E_GLOBAL - E, (M, TOP_K - 1), device="cuda", generator=gen)
    others = torch.where(others >= E_START, others + E, others)
    ids = torch.cat([local[:, None], others], 1)
    w = torch.rand(M, TOP_K, device="cuda", generator=gen)
    return z, ids, w / w.sum(1, keepdim=True)


@triton.jit
def _tile_pass_kernel(w_ptr, s_ptr, out_ptr, expert_words, expert_scale_words, second_words, second_scale_words,
                      STEPS: tl.constexpr, PAIRED: tl.constexpr, STEP: tl.constexpr, SSTEP: tl.constexpr):
    """Program (e, j) reads row block j of expert e in the row-tiled layout (and, PAIRED, the block second_words
    further on: the up rows beside the gate rows), K step by K step as the decode kernels do, bytes and scales, and
    keeps only an XOR of them: the decode's traffic and grid without its decode and MMA."""
    e, j = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    w = w_ptr + e * expert_words + j * STEPS * STEP + tl.arange(0, STEP)
    s = s_ptr + e * expert_scale_words + j * STEPS * SSTEP + tl.arange(0, SSTEP)
    acc = tl.zeros((STEP,), tl.int32)
    acc_s = tl.zeros((SSTEP,), tl.int32)
    for i in tl.range(0, STEPS, num_stages=3):
        acc ^= tl.load(w + i * STEP)
        acc_s ^= tl.load(s + i * SSTEP)
        if PAIRED:
            acc ^= tl.load(w + second_words + i * STEP)
            acc_s ^= tl.load(s + second_scale_words + i * SSTEP)
    tl.store(out_ptr + e * tl.num_programs(1) + j, tl.xor_sum(acc, 0) ^ tl.xor_sum(acc_s, 0))


def tile_pass(w13, s13, w2, s2, blocks: int = 1):
    """Both GEMMs' weights read by _tile_pass_kernel on the decode grid (row blocks of TILE_ROWS, K steps of 256).
    blocks > 1: each program reads that many consecutive row blocks (contiguous in the tiled layout) in one
    pipelined loop, as a longer-lived program would: 14 K steps a program become 14 x blocks."""
    rows, step = mt.TILE_ROWS, mt.STRIDE_BLOCK_K
    words = lambda t: t.view(torch.int32)
    out = torch.empty(E * max(INTER, DL) // rows, dtype=torch.int32, device=w13.device)

    def run():
        _tile_pass_kernel[(E, INTER // rows // blocks)](
            words(w13), words(s13), out, w13[0].numel() // 4, s13[0].numel() // 4, INTER * DL // 8,
            INTER * DL // 128, STEPS=blocks * DL // step, PAIRED=True, STEP=rows * step // 8,
            SSTEP=rows * step // 128, num_warps=4)
        _tile_pass_kernel[(E, DL // rows // blocks)](
            words(w2), words(s2), out, w2[0].numel() // 4, s2[0].numel() // 4, 0, 0, STEPS=blocks * INTER // step,
            PAIRED=False, STEP=rows * step // 8, SSTEP=rows * step // 128, num_warps=4)
    return run


def grouped_mm_baseline(z, ids, w13b, w2b):
    """What a port without an MXFP4 kernel runs: bf16 grouped GEMMs over the sorted pairs."""
    order, offsets, _ = mt.sort_pairs(ids, E_START, E)
    n_local = z.shape[0]  # one local pair per token in these benches
    x = z[(order[:n_local].long() // TOP_K)]
    offs = offsets[1:].to(torch.int32)

    def run():
        h = torch._grouped_mm(x, w13b.transpose(1, 2), offs=offs)
        g, u = h[:, :INTER].float(), h[:, INTER:].float()
        a = (4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)).to(torch.bfloat16)
        return torch._grouped_mm(a, w2b.transpose(1, 2), offs=offs)
    return run


def bench_moe(bw_tbps: float, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = make_weights(gen)
    wbytes = E * expert_bytes(w13, s13, w2, s2)
    floor_ms = wbytes / (bw_tbps * 1e12) * 1e3
    w13b, w2b = mt.dequantize(w13, s13), mt.dequantize(w2, s2)
    laid_out = {}  # expert bytes and scales by the layout a tactic reads (restrided "*_s", paired "*_p", tiled "*_pt")

    def weights(tactic):
        t = mt.TACTICS[tactic] if isinstance(tactic, str) else tactic
        key = (t.strided, t.paired, t.lane, t.tiled)
        if key not in laid_out:
            laid_out[key] = mt.lay_out_experts(t, w13, s13, w2, s2)
        return laid_out[key]
    # the row-tiled layout's bytes read on the decode grid with no decode or MMA: how close this traffic can get,
    # and whether longer programs (several row blocks each) would get closer
    for blocks in (1, 2, 4, 8):
        t_pass = time_ms(tile_pass(*weights("decode_p"), blocks=blocks))
        emit(bench="moe_tile_pass", row_blocks_per_program=blocks, ms=round(t_pass, 4),
             frac_of_floor=round(floor_ms / t_pass, 3))
    # correctness first, on a small ragged batch incl. empty experts, against the torch reference
    z, ids, tw = make_tokens(1, gen)
    z, ids, tw = z[:37], ids[:37], tw[:37]
    ref = moe_ref(z, ids, tw, w13, s13, w2, s2, expert_start=E_START, act="situ")
    for name in mt.TACTICS:
        a, sa, b, sb = weights(name)
        out = mt.moe_experts(mt.lay_out_input(name, z), ids, tw, a, sa, b, sb, expert_start=E_START, act="situ",
                             tactic=name)
        emit(bench="moe_check", tactic=name, rel_l2=rel_l2(out, ref), cosine=cosine(out, ref))
    decode_sweep, prefill_sweep = {}, {}
    if sweep:  # the relaid layouts' blocks (the checkpoint-order tactics are known slower: TACTICS keeps them)
        for bn, nw, st in ((64, 4, 2), (64, 4, 4), (128, 8, 3)):
            decode_sweep[f"d_bn{bn}_bk256_w{nw}_s{st}_paired"] = mt.MoETactic(16, bn, 256, nw, st, strided=True,
                                                                               paired=True, tiled=True)
        decode_sweep["d_bn64_bk256_w4_s3_untiled"] = mt.MoETactic(16, 64, 256, 4, 3, strided=True, paired=True)
        # decode_l's blocks at several tokens an expert: every program of an expert reads its rows of z from L2
        # (57 KB at 8 tokens, half its 114 KB of weights with BN 64), so wider programs may pay off there
        for bn, nw, st, dbn, dnw in ((64, 4, 4, None, None), (128, 8, 3, None, None), (128, 4, 3, None, None),
                                     (64, 8, 3, None, None), (64, 4, 3, 128, 8), (128, 8, 3, 64, 4)):
            down = f"_d{dbn}w{dnw}" if dbn else ""
            decode_sweep[f"d_bn{bn}_bk256_w{nw}_s{st}{down}_lane"] = replace(
                mt.TACTICS["decode_l"], block_n=bn, num_warps=nw, num_stages=st, down_block_n=dbn, down_num_warps=dnw)
        for bm, bn, nw, st in ((64, 128, 4, 3), (128, 64, 4, 3), (128, 256, 8, 2)):
            prefill_sweep[f"p_bm{bm}_bn{bn}_bk256_w{nw}_s{st}_paired"] = mt.MoETactic(bm, bn, 256, nw, st,
                                                                                       strided=True, paired=True,
                                                                                       tiled=True)
        for bm, bn, nw, st, mul in ((128, 128, 8, 2, False), (64, 128, 8, 2, True), (64, 128, 8, 3, True),
                                    (64, 128, 8, 2, False), (128, 128, 8, 3, False)):
            prefill_sweep[f"p_bm{bm}_bn{bn}_bk256_w{nw}_s{st}_lane{'_mul' if mul else ''}"] = mt.MoETactic(
                bm, bn, 256, nw, st, strided=True, paired=True, lane=True, tiled=True, rows_first=True,
                packed_mul=mul)
        for bm, bn, nw, st in ((128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (64, 64, 4, 3)):
            prefill_sweep[f"p_bm{bm}_bn{bn}_bk256_w{nw}_s{st}_fp8"] = mt.MoETactic(bm, bn, 256, nw, st, strided=True,
                                                                                    fp8=True)
    # the gate/up programs asking L2 for their first K steps of weights (16 KB each) while the pair sort runs
    # (MoETactic.prefetch); decode_l_yh was the fastest at 2-8 tokens an expert (8 steps: 10 % slower, H100)
    for steps in (2, 4):
        decode_sweep[f"decode_l_yh_pf{steps}"] = replace(mt.TACTICS["decode_l_yh"], prefetch=steps)
    for per_sm in (2, 4):  # the first programs only (MoETactic.prefetch_per_sm)
        decode_sweep[f"decode_l_yh_pf2_w{per_sm}"] = replace(mt.TACTICS["decode_l_yh"], prefetch=2,
                                                             prefetch_per_sm=per_sm)
    for tpe in (1, 2, 4, 8, 128):
        z, ids, tw = make_tokens(tpe, gen)
        flops = 2 * z.shape[0] * 3 * DL * INTER
        base = grouped_mm_baseline(z, ids, w13b, w2b)
        t_base = time_ms(base)
        rec = dict(bench="moe", tokens_per_expert=tpe, M=z.shape[0], experts=E, weight_bytes=wbytes,
                   hbm_tbps=round(bw_tbps, 3), floor_ms=round(floor_ms, 4), grouped_mm_bf16_ms=round(t_base, 4))
        tactics = dict(mt.TACTICS, **(prefill_sweep if tpe >= 64 else decode_sweep))
        names = [n for n in tactics if not n.startswith("prefill")] if tpe < 64 else list(tactics)
        best = None
        for name in names:
            try:
                a, sa, b, sb = weights(tactics[name])
                zt = mt.lay_out_input(tactics[name], z)  # permuted before the timed calls
                fn = lambda name=name, a=a, sa=sa, b=b, sb=sb, zt=zt: mt.moe_experts(zt, ids, tw, a, sa, b, sb,
                                                                              expert_start=E_START, act="situ",
                                                                              tactic=tactics[name])
                t = time_ms(fn)
            except Exception as exc:  # a config that does not compile is a result, not a crash
                emit(bench="moe_config_failed", tactic=name, error=repr(exc)[:300])
                continue
            emit(bench="moe_tactic", tokens_per_expert=tpe, tactic=name, ms=round(t, 4),
                 frac_of_floor=round(floor_ms / t, 3), tflops=round(flops / t / 1e9, 1))
            if best is None or t < best[1]:
                best = (name, t)
        if tpe >= 64:
            def dq_once():
                a = mt.dequantize(w13, s13)
                b = mt.dequantize(w2, s2)
                return a, b
            t_dq = time_ms(dq_once, rep=5)
            rec.update(dequant_once_ms=round(t_dq, 4), dequant_once_plus_grouped_mm_ms=round(t_dq + t_base, 4))
        rec.update(best_tactic=best[0], best_ms=round(best[1], 4), frac_of_floor=round(floor_ms / best[1], 3),
                   speedup_vs_grouped_mm=round(t_base / best[1], 2), tflops=round(flops / best[1] / 1e9, 1),
                   grouped_mm_tflops=round(flops / t_base / 1e9, 1))
        emit(**rec)
