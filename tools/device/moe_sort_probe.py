"""The MoE's pair sort alone (device probe, JSON lines): sort_pairs_kernel with its pairs in tiles of COLS 1 (one
flat scan, as the kernel before the thirty-second session took, though not its exact code) against 2, 4 (the host's,
SORT_COLS) and 8, at a rank's decode sizes and bench_plugins' 8 tokens/expert, in the host's block and warps and a
few around them; CUDA-graph medians, µs."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import torch  # noqa: E402
import triton  # noqa: E402
from common import emit, time_ms  # noqa: E402
from k3plugins.moe.triton_kernels import sort_pairs_kernel  # noqa: E402


def main() -> None:
    E, start = 56, 112
    for M in (448, 32, 128):  # bench_plugins' 8 tokens an expert first, then a rank's decode sizes
        g = torch.Generator(device="cuda").manual_seed(M)
        ids = torch.stack([torch.randperm(896, device="cuda", generator=g)[:16] for _ in range(M)])
        P = ids.numel()
        order, inv = torch.empty(P, dtype=torch.int32, device="cuda"), torch.empty(P, dtype=torch.int32, device="cuda")
        offs = torch.empty(E + 1, dtype=torch.int32, device="cuda")
        done = torch.empty(E, dtype=torch.int32, device="cuda")
        rec = dict(bench="moe_sort", M=M, P=P)
        configs = {(min(b, triton.next_power_of_2(P)), w) for b, w in ((8192, 4), (8192, 8), (8192, 16), (2048, 4))}
        for block, warps in sorted(configs):
            for cols in (1, 2, 4, 8):
                run = lambda block=block, warps=warps, cols=cols: sort_pairs_kernel[(E + 1,)](
                    ids, order, offs, inv, P, start, E, BLOCK=block, COLS=cols, done_ptr=done, ZERO_DONE=True,
                    num_warps=warps)
                rec[f"cols{cols}_b{block}_w{warps}_us"] = round(time_ms(run, flush=False) * 1e3, 2)
        emit(**rec)


if __name__ == "__main__":
    main()
