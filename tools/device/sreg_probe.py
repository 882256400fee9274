"""A/B probe: decode_l (the lane gate/up kernel's scales through Triton's pipeline buffers) against decode_l_sr (the
scales prefetched into registers a K step ahead: 57344 bytes of shared, four programs an SM) on the rank's 56 experts
at 8, 1 and 4 tokens an expert: interleaved rounds of graph-timed medians, the outputs compared bit for bit, and the
driver's occupancy of each compiled gate/up kernel. JSON lines."""
from __future__ import annotations

import ctypes
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import torch  # noqa: E402
from common import emit, hbm_read_tbps, time_ms  # noqa: E402
from k3plugins.moe import triton as mt  # noqa: E402
from moe import E_START, laid_out_experts, make_tokens  # noqa: E402

orig = mt.moe_gate_up_kernel
got = {}


class Capture:
    def __getitem__(self, grid):
        launch = orig[grid]

        def call(*a, **k):
            got["k"] = launch(*a, **k)
            return got["k"]
        return call


def occupancy(k) -> dict:
    cuda = ctypes.CDLL("libcuda.so.1")
    n, static = ctypes.c_int(), ctypes.c_int()
    cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(k.function), 128,
                                                     ctypes.c_size_t(k.metadata.shared))
    cuda.cuFuncGetAttribute(ctypes.byref(static), 1, ctypes.c_void_p(k.function))
    return dict(blocks_per_sm=n.value, static_shared=static.value, dyn_shared=k.metadata.shared, regs=k.n_regs)


def main() -> None:
    bw = hbm_read_tbps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    laid, one_expert = laid_out_experts(gen, mt.TACTICS["decode_l"])
    mt.moe_gate_up_kernel = Capture()
    emit(bench="sreg_env", hbm_read_tbps=round(bw, 3), device=torch.cuda.get_device_name())
    for tpe in (8, 1, 4):
        z, ids, tw = make_tokens(tpe, gen, touched=56)
        zt = mt.lay_out_input(mt.TACTICS["decode_l"], z)  # decode_l_sr reads the same layouts
        fns = {sreg: (lambda t=("decode_l_sr" if sreg else "decode_l"):
                      mt.moe_experts(zt, ids, tw, *laid, expert_start=E_START, act="situ", tactic=t))
               for sreg in (False, True)}
        outs, times = {}, {False: [], True: []}
        for sreg in (False, True):
            outs[sreg] = fns[sreg]().clone()
            emit(bench="sreg_occupancy", sreg=sreg, **occupancy(got["k"]))
        for _ in range(4):
            for sreg in (False, True):
                times[sreg].append(time_ms(fns[sreg]))
        floor = 56 * one_expert / (bw * 1e12) * 1e3
        emit(bench="sreg", tpe=tpe, same=bool(torch.equal(outs[False], outs[True])), floor_ms=round(floor, 4),
             ms_shared=[round(x, 4) for x in times[False]], ms_sreg=[round(x, 4) for x in times[True]],
             of_floor_shared=round(floor / min(times[False]), 3), of_floor_sreg=round(floor / min(times[True]), 3))


if __name__ == "__main__":
    main()
