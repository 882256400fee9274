"""Find NaN or Inf in a weight tensor fast: convert screens every float tensor it reads, build every one it
re-lays out (a file changed after convert)."""

from __future__ import annotations

import torch

FINITE_CHUNK = 1 << 24
# Smallest |x| bit pattern (sign masked off) that is Inf or NaN, per 16-bit float dtype.
_NONFINITE_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _chunk_finite(c: torch.Tensor) -> bool:
    """Fast screen of one chunk; a False is confirmed and located by the caller."""
    if c.dtype in _NONFINITE_BITS:  # integer max over the bit patterns: ~4x faster than isfinite on bf16
        return int((c.view(torch.int16) & 0x7FFF).max()) < _NONFINITE_BITS[c.dtype]
    # NaN/Inf propagate through a sum; an overflowing sum of finite values only costs the precise re-check.
    return bool(torch.isfinite(c.sum()))


def first_nonfinite(t: torch.Tensor) -> int | None:
    """The flat index of t's first NaN or Inf, None when it has none (t a float tensor)."""
    flat = t.reshape(-1)
    for s in range(0, flat.numel(), FINITE_CHUNK):
        c = flat[s: s + FINITE_CHUNK]
        if _chunk_finite(c):
            continue
        ok = torch.isfinite(c)
        if not bool(ok.all()):
            return s + int((~ok).nonzero()[0, 0])
    return None
