"""Paged MLA cache and KDA slot pool.

`PagePool` / `SlotPool` are pure bookkeeping (the scheduler imports them without torch);
`CacheTensors` / `HostStore` hold the tensors and load lazily so importing the pools stays torch-free.
"""

from .page_pool import PagePool, pages_needed
from .slot_pool import SlotPool

__all__ = ["PagePool", "SlotPool", "pages_needed", "CacheConfig", "CacheTensors", "HostStore"]

_LAZY = {"CacheConfig": "cache_tensors", "CacheTensors": "cache_tensors", "HostStore": "host_store"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
