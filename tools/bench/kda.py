"""KDA decode/prefill: our glue + fla-core vs fla-core's kernel alone and the state-bytes floor (H=96, K=128)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common import emit, rel_l2, time_ms, top_kernels
from k3plugins.embed.dense import dense
from k3plugins.kda import fla as kda_dev

H, K = 96, 128
D = H * K
RANK_HEADS = 6  # a TEP16 rank's share of K3's 96 heads (bench_rank's shape)
# (tactic, block_v, num_warps, maxnreg) of the decode sweep: the split tactic's state slice (fused takes a head's
# whole state); maxnreg None is the tactic's default (fused: kda_dev.fused_maxnreg, by grid), 0 no cap (fused: 213
# registers, two programs an SM), FUSED_MAXNREG three programs an SM. Fused at 8 warps and split at 64 rows or 8
# warps were slower everywhere in the earlier sweeps (BENCHMARKS.md).
DECODE_CONFIGS = [("split", 32, 4, None), ("split", 128, 4, None), ("fused", None, 4, None), ("fused", None, 4, 0),
                  ("fused", None, 4, kda_dev.FUSED_MAXNREG)]


@triton.jit
def _touch_slices_kernel(p, BLOCK: tl.constexpr):
    """Each program reads one [block_v, K] state slice and writes it back unchanged: the split kernel's traffic and
    grid without its math (block_v = K: the fused kernel's, a head's whole state a program)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(p + offs, tl.load(p + offs))


def _inputs(N: int, gen: torch.Generator, state_dtype=torch.float32, H: int = H):
    D = H * K
    r = lambda *s, sc=1.0: torch.randn(*s, device="cuda", generator=gen) * sc
    # the projections' outputs in the activation dtype, as the engine hands them over
    qkv, g_raw, b, g_out = (r(N, n).to(torch.bfloat16) for n in (3 * D, D, H, D))
    conv_w, a_log, dt_bias, norm_w = r(3 * D, 4, sc=0.5), r(H, sc=0.5), r(D, sc=0.5), 1 + 0.1 * r(K)
    pool = r(N, H, K, K, sc=0.05).to(state_dtype)
    conv_pool = r(N, 3 * D, 3).to(torch.bfloat16)
    slots = torch.randperm(N, device="cuda", generator=gen).to(torch.int32)
    return qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, slots


def _prefill_inputs(lens: list[int], gen: torch.Generator):
    """_inputs for a prefill of sequences of `lens` tokens: a row of activations a token, a state a sequence (not a
    token: 8K fp32 states would be 48 GiB), and cu_seqlens."""
    T, N = sum(lens), len(lens)
    *_, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, slots = _inputs(N, gen)
    qkv, g_raw, b, g_out = (torch.randn(T, n, device="cuda", generator=gen).to(torch.bfloat16)
                            for n in (3 * D, D, H, D))
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    return qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, slots, cu


def bench_kda(bw_tbps: float, sweep: bool) -> None:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    gen = torch.Generator(device="cuda").manual_seed(2)
    for N in (8, 64, 256):
        args = _inputs(N, gen)
        qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, slots = args
        floor_ms = 2 * pool.numel() * 4 / (bw_tbps * 1e12) * 1e3
        rec = dict(bench="kda_decode", N=N, H=H, state_bytes_rw=2 * pool.numel() * 4, floor_ms=round(floor_ms, 4))
        # fla-core's kernel alone, in place by index (its inputs already made)
        q, k, v = (torch.randn(1, N, H, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
        cu = torch.arange(N + 1, device="cuda")
        gr, bb = g_raw.float().view(1, N, H, K), b.float().view(1, N, H)  # as fla-core takes them
        alone = lambda: fused_recurrent_kda_fwd(q, k, v, gr, bb, A_log=a_log, dt_bias=dt_bias, initial_state=pool,
                                                scale=K ** -0.5, inplace_final_state=True, state_v_first=True,
                                                cu_seqlens=cu, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
                                                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                                lower_bound=-5.0)
        t_alone = time_ms(alone)
        rec.update(fla_alone_ms=round(t_alone, 4), fla_alone_x_floor=round(t_alone / floor_ms, 2))
        # the same bytes read and written back by torch's in-place elementwise kernel, no math to speak of: what
        # HBM gives this read-modify-write traffic (the floor counts it at the read-only speed)
        t_pass = time_ms(lambda: pool.mul_(1.0))
        rec.update(inplace_pass_ms=round(t_pass, 4), inplace_pass_frac_of_floor=round(floor_ms / t_pass, 3))
        bv = kda_dev.decode_block_v(N, H)
        t_touch = time_ms(lambda: _touch_slices_kernel[(pool.numel() // (bv * K),)](pool, BLOCK=bv * K, num_warps=4))
        rec.update(slice_pass_ms=round(t_touch, 4), slice_pass_frac_of_floor=round(floor_ms / t_touch, 3))
        t_head = time_ms(lambda: _touch_slices_kernel[(pool.numel() // (K * K),)](pool, BLOCK=K * K, num_warps=4))
        rec.update(head_pass_ms=round(t_head, 4), head_pass_frac_of_floor=round(floor_ms / t_head, 3))
        outs = {}
        pool_in, conv_in = pool.clone(), conv_pool.clone()  # the timed runs below update pool in place
        for tactic in kda_dev.DECODE_TACTICS:
            p0, c0 = pool_in.clone(), conv_in.clone()
            outs[tactic] = kda_dev.kda_decode(*args[:8], p0, c0, slots, num_heads=H, head_dim=K, lower_bound=-5.0,
                                              eps=1e-5, tactic=tactic).float()
            outs[tactic + "_state"] = p0
            fn = lambda tactic=tactic: kda_dev.kda_decode(*args, num_heads=H, head_dim=K, lower_bound=-5.0,
                                                          eps=1e-5, tactic=tactic)
            t = time_ms(fn)
            rec[f"{tactic}_ms"] = round(t, 4)
            rec[f"{tactic}_frac_of_floor"] = round(floor_ms / t, 3)
            rec[f"{tactic}_x_inplace_pass"] = round(t / t_pass, 3)
        # the fused tactic's gate from f_a, f_b applied inside, against the f_b GEMM then the same kernel
        f_a = torch.randn(N, K, device="cuda", generator=gen).to(torch.bfloat16)
        f_b = (torch.randn(D, K, device="cuda", generator=gen) * K ** -0.5).to(torch.bfloat16)
        kw = dict(num_heads=H, head_dim=K, lower_bound=-5.0, eps=1e-5, tactic="fused")
        t_gemm = time_ms(lambda: kda_dev.kda_decode(qkv, dense(f_a, f_b), *args[2:], **kw))
        t_inside = time_ms(lambda: kda_dev.kda_decode(qkv, f_a, *args[2:], f_b_weight=f_b, **kw))
        rec.update(fused_after_f_b_gemm_ms=round(t_gemm, 4), fused_f_b_inside_ms=round(t_inside, 4),
                   fused_f_b_inside_frac_of_floor=round(floor_ms / t_inside, 3))
        base = kda_dev.DECODE_TACTICS[0]
        for tactic in kda_dev.DECODE_TACTICS[1:]:
            rec[f"{tactic}_vs_{base}_rel_l2"] = rel_l2(outs[tactic], outs[base])
            rec[f"{tactic}_vs_{base}_state_rel_l2"] = rel_l2(outs[tactic + "_state"], outs[base + "_state"])
        emit(**rec)
        if sweep:
            _sweep_configs(args, N, H, floor_ms)
        del args, pool, conv_pool
        torch.cuda.empty_cache()
    if sweep:
        _sweep_rank_heads(bw_tbps, gen)
    bench_kda_prefill(bw_tbps, sweep)


def _sweep_configs(args, N: int, heads: int, floor_ms: float) -> None:
    """Every DECODE_CONFIGS entry on one batch's inputs."""
    for tactic, bv, nw, reg in DECODE_CONFIGS:
        fn = lambda tactic=tactic, bv=bv, nw=nw, reg=reg: kda_dev.kda_decode(
            *args, num_heads=heads, head_dim=K, lower_bound=-5.0, eps=1e-5, tactic=tactic, block_v=bv, num_warps=nw,
            maxnreg=reg)
        t = time_ms(fn)
        emit(bench="kda_decode_config", N=N, H=heads, tactic=tactic, block_v=bv, num_warps=nw, maxnreg=reg,
             ms=round(t, 4), frac_of_floor=round(floor_ms / t, 3))


def _sweep_rank_heads(bw_tbps: float, gen: torch.Generator) -> None:
    """The decode configs at a rank's 6 heads: N·6 programs are fewer than two waves of 132 SMs at 32 requests,
    where narrower slices give the split tactic more programs."""
    for N in (32, 64, 128):
        args = _inputs(N, gen, H=RANK_HEADS)
        _sweep_configs(args, N, RANK_HEADS, 2 * args[8].numel() * 4 / (bw_tbps * 1e12) * 1e3)
        del args


def bench_kda_prefill(bw_tbps: float, sweep: bool) -> None:
    """Prefill of one 8K sequence, glue included, vs chunk_kda alone (and each glue stage alone)."""
    from fla.ops.kda import chunk_kda
    gen = torch.Generator(device="cuda").manual_seed(2)
    T = 8192
    qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, slots, cu = _prefill_inputs([T], gen)
    q, k, v = (torch.randn(1, T, H, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    gr, bb = g_raw.view(1, T, H, K), b.float().view(1, T, H)
    # the baseline: chunk_kda doing all of the layer's core itself, the q/k L2 norm included (kda_prefill does that
    # norm in its conv kernel instead, and counts it as glue)
    alone = lambda: chunk_kda(q, k, v, gr, bb, scale=K ** -0.5, initial_state=pool.clone(), output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                              safe_gate=True, lower_bound=-5.0, state_v_first=True, cu_seqlens=cu, A_log=a_log,
                              dt_bias=dt_bias)
    t_alone = time_ms(alone, rep=10, graph=False)
    ours = lambda: kda_dev.kda_prefill(qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, cu,
                                       slots, num_heads=H, head_dim=K, lower_bound=-5.0, eps=1e-5)
    t_ours = time_ms(ours, rep=10, graph=False)
    emit(bench="kda_prefill", T=T, H=H, chunk_kda_alone_ms=round(t_alone, 4), ours_ms=round(t_ours, 4),
         ours_x_alone=round(t_ours / t_alone, 3), tokens_per_s=round(T / t_ours * 1e3))
    # the kernels of each, to tell the glue's own kernels from launch gaps and from chunk_kda's inner ones; in an
    # engine step the host runs ahead, so the ratio of kernel times is the one a step sees (chunk_kda alone leaves
    # the GPU idle for part of its wall time, which our conv kernel hides)
    k_ours, k_alone = top_kernels(ours, 12), top_kernels(alone, 12)
    emit(bench="kda_prefill_kernels", kernel_ms_ours=k_ours[0][1], kernel_ms_alone=k_alone[0][1],
         kernel_ours_x_alone=round(k_ours[0][1] / k_alone[0][1], 3), ours=k_ours, chunk_kda_alone=k_alone)
    _prefill_breakdown(qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, cu, slots, t_alone,
                       bw_tbps, sweep)
    _prefill_layout_rows(gen)


def _prefill_layout_rows(gen, layers: int = 8) -> None:
    """A step's KDA prefill layers (`layers` of them, a new cu_seqlens each step as the engine makes) with
    chunk_kda's chunk layout built on the device (CHUNK_LAYOUT_ON_DEVICE: a few small launches a layer) against
    read on the host (a sync in the first layer, the layout cached for the others): one 8K prompt, and a mixed
    step of 32 decode rows beside a 480-token chunk."""
    for lens in ([8192], [1] * 32 + [480]):
        qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, slots, cu = _prefill_inputs(lens, gen)
        T, N = qkv.shape[0], len(lens)

        def step():
            fresh = cu.clone()
            for _ in range(layers):
                kda_dev.kda_prefill(qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, fresh,
                                    slots, num_heads=H, head_dim=K, lower_bound=-5.0, eps=1e-5)
        ms, default = {}, kda_dev.CHUNK_LAYOUT_ON_DEVICE
        try:
            for on_device in (True, False):
                kda_dev.CHUNK_LAYOUT_ON_DEVICE = on_device
                ms[on_device] = time_ms(step, rep=10, graph=False)
        finally:
            kda_dev.CHUNK_LAYOUT_ON_DEVICE = default  # the sections after run the engine's setting
        emit(bench="kda_prefill_layout", T=T, seqs=N, layers=layers, layout_on_device_ms=round(ms[True], 4),
             layout_on_host_ms=round(ms[False], 4), device_x_host=round(ms[True] / ms[False], 3))


def _prefill_breakdown(qkv, g_raw, b, g_out, conv_w, a_log, dt_bias, norm_w, pool, conv_pool, cu, slots, t_alone,
                       bw_tbps, sweep):
    """Each stage of kda_prefill timed alone, to find where the glue goes (with sweep: the conv's tile shapes)."""
    import triton
    from fla.ops.kda import chunk_kda
    from k3plugins.kda.triton_decode import conv_prefill_rows_kernel, conv_state_kernel
    T = qkv.shape[0]
    y = torch.empty(3, T, D, dtype=qkv.dtype, device="cuda")
    tok_seq = torch.zeros(T, dtype=torch.int32, device="cuda")
    grid_c = triton.cdiv(3 * D, 1024)

    def conv(bt=kda_dev.CONV_PREFILL_BT, bc=kda_dev.conv_channel_block(D), nw=kda_dev.CONV_PREFILL_WARPS):
        conv_prefill_rows_kernel[(triton.cdiv(T, bt), 3 * D // bc)](
            qkv, conv_w, conv_pool, slots, cu, tok_seq, y, T, qkv.stride(0), conv_pool.stride(0), 3 * D, D, W=4,
            BT=bt, BC=bc, NORM_K=K if bc % K == 0 else 0, num_warps=nw)

    stages = {
        "conv_prefill": conv,
        "conv_state": lambda: conv_state_kernel[(1, grid_c)](qkv, conv_pool.clone(), slots, cu, qkv.stride(0),
                                                             conv_pool.stride(0), 3 * D, W=4, BC=1024),
        "norm": lambda: kda_dev._gated_norm(y[0], g_out, norm_w, torch.empty(T, D, dtype=torch.bfloat16, device="cuda"),
                                            H, K, 1e-5),
    }
    q, k, v = (t.view(1, T, H, K) for t in y)
    gr = g_raw.reshape(1, T, H, K)
    stages["chunk_kda_on_conv_output"] = lambda: chunk_kda(
        q, k, v, gr, b.float().reshape(1, T, H), scale=K ** -0.5, initial_state=pool.float().clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, state_v_first=True, cu_seqlens=cu,
        A_log=a_log.float(), dt_bias=dt_bias.float())  # as kda_prefill calls it: q and k come normed from the conv
    rec = dict(bench="kda_prefill_breakdown", T=T, chunk_kda_alone_ms=round(t_alone, 4))
    for name, fn in stages.items():
        rec[f"{name}_ms"] = round(time_ms(fn, rep=10, graph=False), 4)
    emit(**rec)
    if sweep:  # conv tiles: bytes moved (qkv read once, y written once) over the measured HBM speed
        floor_ms = 2 * qkv.numel() * qkv.element_size() / (bw_tbps * 1e9)
        for bt in (32, 64, 128):
            for bc in (128, 256, 512):
                for nw in (1, 2, 4):
                    t = time_ms(lambda: conv(bt, bc, nw), rep=10, graph=False)
                    emit(bench="kda_conv_config", BT=bt, BC=bc, num_warps=nw, ms=round(t, 4),
                         frac_of_floor=round(floor_ms / t, 3))
