"""Fail-fast check for `--enable-deepep` (the multi-rank expert-parallel path is owned by k3runtime.dist)."""

from __future__ import annotations

import importlib


class DeepEPUnavailable(RuntimeError):
    pass


def require_deepep():
    """Import and return `deep_ep`, or raise DeepEPUnavailable saying why and what to do."""
    try:
        return importlib.import_module("deep_ep")
    except Exception as e:  # ImportError, or a broken CUDA extension raising OSError/RuntimeError at import
        raise DeepEPUnavailable(
            f"--enable-deepep: the 'deep_ep' package does not import ({type(e).__name__}: {e}). Install DeepEP "
            "(it needs CUDA and NVSHMEM) on every rank, or start without --enable-deepep.") from e
