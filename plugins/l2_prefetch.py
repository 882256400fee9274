"""Pull the first bytes of a weight into L2 from a second stream, while the main stream runs latency-bound kernels.

A decode step alternates kernels that stream weights at HBM speed (GEMMs, the MoE, the KDA/MLA cores) with
short ones that move almost nothing (AttnRes, norms, sorts): HBM idles through the latter. A few bulk prefetches
(`cp.async.bulk.prefetch.L2`, sm_90: one instruction a 4 KB chunk, no registers, no shared memory) issued on a
side stream there let the next GEMM find its first rows in L2. Measured on an H200 (tools/device/l2_prefetch_probe.py,
BENCHMARKS.md): with a ~13 µs window before it, the 59.5 MB MoE in_proj GEMM at 32 tokens takes 22.5 µs after
16-24 MB of it were prefetched by 8 programs, 24.4 µs without; more programs, or plain loads, compete with the
window's kernels and lose. CUDA sm_90+ only: elsewhere `l2_prefetch` does nothing (the PTX has no gfx942 form).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3plugins.pdl import pdl_capable

CHUNK = 4096  # bytes a prefetch instruction asks for (a multiple of 16)
LANES = 32  # one warp a program, each lane its own chunk
PROGRAMS = 8  # few: the window's own kernels keep their SMs (BENCHMARKS.md: 8 beat 32)
_ASM = f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK};\n mov.u32 $0, 0;"


@triton.jit
def l2_prefetch_kernel(w_ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, ASM: tl.constexpr):
    """Bulk-prefetch bytes [0, nbytes) of w_ptr (u8, 16-byte aligned, nbytes >= CHUNK) into L2, CHUNK a lane; the
    last chunk is moved back to end at nbytes (a repeated prefetch is harmless)."""
    lane = tl.arange(0, LANES).to(tl.int64)
    span: tl.constexpr = LANES * CHUNK
    for base in range(tl.program_id(0).to(tl.int64) * span, nbytes, tl.num_programs(0).to(tl.int64) * span):
        offs = tl.minimum(base + lane * CHUNK, nbytes - CHUNK)
        addr = (w_ptr + offs).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise(ASM, "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


def supported(t: torch.Tensor) -> bool:
    """Whether l2_prefetch does anything for t: the hardware PDL needs too (CUDA, not ROCm; sm_90 or newer)."""
    return pdl_capable(t)


def l2_prefetch(t: torch.Tensor, nbytes: int) -> None:
    """Ask L2 for the first nbytes of contiguous tensor t (rounded down to whole chunks); no wait, no result.
    Nothing for a tensor the bulk prefetch cannot take (not 16-byte aligned, not contiguous)."""
    nbytes = min(nbytes, t.nbytes) // CHUNK * CHUNK
    if nbytes == 0 or not supported(t) or t.data_ptr() % 16 or not t.is_contiguous():
        return
    l2_prefetch_kernel[(PROGRAMS,)](t.view(torch.uint8).reshape(-1), nbytes, CHUNK=CHUNK, LANES=LANES, ASM=_ASM,
                                    num_warps=1)
