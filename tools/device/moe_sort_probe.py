"""The MoE's pair sort alone (device probe, JSON lines): sort_pairs_kernel against the twenty-third session's
(old_sort_pairs_kernel, copied here as it was, less its PDL prologue), at a rank's decode sizes and
bench_plugins' 8 tokens/expert, in blocks and warps around the host's choice; CUDA-graph medians, µs."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import emit, time_ms  # noqa: E402
from k3plugins.moe.triton_kernels import sort_pairs_kernel  # noqa: E402


@triton.jit
def old_sort_pairs_kernel(ids_ptr, order_ptr, offs_ptr, inv_ptr, P, expert_start, E, BLOCK: tl.constexpr,
                          done_ptr=None, ZERO_DONE: tl.constexpr = False):
    """Counting sort of the (token, expert) pairs by local expert, program e owning expert e (program E: the
    pairs of other ranks' experts, placed last with inv -1). Its start is the count of smaller keys, so the
    programs need nothing from each other; within an expert, pairs keep their order (a prefix sum).
    ZERO_DONE: also zero done[e], the gate/up kernel's count of finished programs (SIGNAL)."""
    e = tl.program_id(0)
    if ZERO_DONE:
        if e < E:
            tl.store(done_ptr + e, 0)
    offs = tl.arange(0, BLOCK)
    start = 0
    for c0 in range(0, P, BLOCK):  # pass 1: how many pairs sort before expert e
        p = c0 + offs
        key = tl.load(ids_ptr + p, mask=p < P, other=0) - expert_start
        key = tl.where((key >= 0) & (key < E), key, E)
        start += tl.sum(((key < e) & (p < P)).to(tl.int32), axis=0)
    tl.store(offs_ptr + e, start)  # program E stores offsets[E], the count of local pairs
    for c0 in range(0, P, BLOCK):  # pass 2: place expert e's pairs
        p = c0 + offs
        key = tl.load(ids_ptr + p, mask=p < P, other=0) - expert_start
        key = tl.where((key >= 0) & (key < E), key, E)
        hit = (key == e) & (p < P)
        pos = start + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(order_ptr + pos, p, mask=hit)
        tl.store(inv_ptr + p, tl.where(e < E, pos, -1), mask=hit)
        start += tl.sum(hit.to(tl.int32), axis=0)



def main() -> None:
    E, start = 56, 112
    for M in (32, 128, 448):
        g = torch.Generator(device="cuda").manual_seed(M)
        ids = torch.stack([torch.randperm(896, device="cuda", generator=g)[:16] for _ in range(M)])
        P = ids.numel()
        order, inv = torch.empty(P, dtype=torch.int32, device="cuda"), torch.empty(P, dtype=torch.int32, device="cuda")
        offs = torch.empty(E + 1, dtype=torch.int32, device="cuda")
        done = torch.empty(E, dtype=torch.int32, device="cuda")
        rec = dict(bench="moe_sort", M=M, P=P)
        configs = {(min(b, triton.next_power_of_2(P)), w)
                   for b, w in ((4096, 4), (8192, 4), (8192, 8), (8192, 16), (2048, 4), (1024, 4))}
        for block, warps in sorted(configs):
            for name, kern in (("new", sort_pairs_kernel), ("old", old_sort_pairs_kernel)):
                run = lambda kern=kern, block=block, warps=warps: kern[(E + 1,)](
                    ids, order, offs, inv, P, start, E, BLOCK=block, done_ptr=done, ZERO_DONE=True, num_warps=warps)
                rec[f"{name}_b{block}_w{warps}_us"] = round(time_ms(run, flush=False) * 1e3, 2)
        emit(**rec)


if __name__ == "__main__":
    main()
