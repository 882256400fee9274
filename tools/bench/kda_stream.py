"""The experimental stream tactic of the KDA decode (a persistent grid prefetching state slices) against the split
tactic, side by side at H=96, with the state-bytes floor and the split grid's read-and-write-back pass as marks."""

from __future__ import annotations

import torch

from common import emit, rel_l2, time_ms
from kda import H, K, _inputs, _touch_slices_kernel
from k3plugins.kda import fla as kda_dev

# (block_v, stages, programs_per_sm), each grid one wave: in the sm_90 SASS block 32 takes 121 / 128 / 161 registers
# a thread at 2 / 3 / 4 stages (4 / 4 / 3 programs fit an SM), block 64 168 / 234 at 2 / 3 (3 / 2), block 128 at
# 2 stages 255 with spills (2)
STREAM_CONFIGS = [(32, 2, 4), (32, 3, 4), (32, 4, 3), (64, 2, 2), (64, 2, 3), (64, 3, 2), (128, 2, 1), (128, 2, 2)]


def bench_kda_stream(bw_tbps: float, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    configs = STREAM_CONFIGS if sweep else [(kda_dev.STREAM_BLOCK_V, kda_dev.STREAM_STAGES,
                                             kda_dev.STREAM_PROGRAMS_PER_SM)]
    for N in (8, 64, 256):
        args = _inputs(N, gen)
        pool = args[8]
        floor_ms = 2 * pool.numel() * 4 / (bw_tbps * 1e12) * 1e3
        kw = dict(num_heads=H, head_dim=K, lower_bound=-5.0, eps=1e-5)
        t_split = time_ms(lambda: kda_dev.kda_decode(*args, **kw))
        bv = kda_dev.decode_block_v(N, H)
        t_pass = time_ms(lambda: _touch_slices_kernel[(pool.numel() // (bv * K),)](pool, BLOCK=bv * K, num_warps=4))
        emit(bench="kda_stream_base", N=N, H=H, floor_ms=round(floor_ms, 4), split_ms=round(t_split, 4),
             split_frac_of_floor=round(floor_ms / t_split, 3), slice_pass_frac_of_floor=round(floor_ms / t_pass, 3))
        state0, conv0 = pool.clone(), args[9].clone()
        ref_state = state0.clone()
        ref = kda_dev.kda_decode(*args[:8], ref_state, conv0.clone(), args[10], **kw).float()
        for bv, stages, per_sm in configs:
            st = state0.clone()
            out = kda_dev.kda_decode(*args[:8], st, conv0.clone(), args[10], tactic="stream", block_v=bv,
                                     stages=stages, programs_per_sm=per_sm, **kw).float()
            t = time_ms(lambda bv=bv, stages=stages, per_sm=per_sm: kda_dev.kda_decode(
                *args, tactic="stream", block_v=bv, stages=stages, programs_per_sm=per_sm, **kw))
            emit(bench="kda_stream", N=N, block_v=bv, stages=stages, programs_per_sm=per_sm, ms=round(t, 4),
                 frac_of_floor=round(floor_ms / t, 3), x_split=round(t / t_split, 3), rel_l2=rel_l2(out, ref),
                 state_rel_l2=rel_l2(st, ref_state))
        del args, pool, state0, conv0
        torch.cuda.empty_cache()
