"""Counts in global memory by which the programs of Triton kernels wait for each other: a program signals after its
stores (release: whoever sees the count sees them), another awaits a count (acquire: its loads after the wait see
them). Used where one launch waits on part of another (the MoE decode's down kernel) or on its own other programs
(AttnRes in one launch); the waiting programs must not keep the awaited ones from running (each user says why)."""

import triton
import triton.language as tl


@triton.jit
def signal_count(count_ptr):
    """Add 1 to *count_ptr once every thread of this program has stored; returns the count before."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="release")


@triton.jit
def await_count(count_ptr, n, LOADS: tl.constexpr = False):
    """Spin until *count_ptr >= n: re-reading it by atomics (acquire); LOADS: by volatile loads, which do not queue
    at L2's atomic unit behind the other waiters' reads, then one acquiring atomic (it reads the last of the
    release sequence, so it sees every signaller's stores)."""
    if LOADS:
        seen = tl.load(count_ptr, volatile=True)
        while seen < n:
            seen = tl.load(count_ptr, volatile=True)
        tl.atomic_add(count_ptr, 0, sem="acquire")
    else:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
        while seen < n:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire")
