"""Programmatic dependent launch (PDL, sm_90+) for the decode step's Triton kernels.

A decode step is about 3000 launches, most of them a few microseconds long, so the gap between one kernel's last
block and the next kernel's first one is a real share of the step. With PDL the next kernel is launched while
the previous one finishes: its blocks take SMs as they free up and wait at `griddepcontrol.wait` until the previous
grid has completed and its writes are visible. Every kernel launched with PDL calls `pdl_prologue` first, before
it reads or writes any memory, so it sees exactly what a plainly ordered launch sees. It signals its own
dependents only after that wait, so at most one grid waits behind a running one. Kernels launched without PDL
(cuBLAS, torch) keep the stream's plain ordering on both sides. CUDA graphs record the dependency.

Off by default: on an H200 the GPU tests pass with it, but a real-size rank's decode step (bench_rank, side by side
in both orders) was no faster with it (BENCHMARKS.md). `K3_PDL=1` turns it on. It stays off on ROCm, below sm_90,
and for CPU tensors (Triton's interpreter). One pair launches with PDL on sm_90 whatever K3_PDL says, because its
second kernel waits for less than the whole first one (`pdl_capable`): the MoE decode's down kernel, each program
awaiting its own expert's rows (MoETactic.overlap, k3plugins/moe).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """The first statement of a kernel launched with `pdl(...)`'s options (nothing when PDL is False)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_capable(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device can be launched with PDL (CUDA, sm_90+), whatever K3_PDL says."""
    return t.is_cuda and torch.version.hip is None and _supported(
        t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl(t: torch.Tensor) -> dict:
    """Launch options for a kernel on t's device: PDL=True plus launch_pdl where PDL runs, else PDL=False."""
    on = os.environ.get("K3_PDL", "0") == "1" and pdl_capable(t)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
