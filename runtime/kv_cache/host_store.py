"""Host copies of swapped-out requests: their MLA pages and KDA slot, bit-exact.

Host page and slot ids are booked by the scheduler (`SwapEntry.host_page_ids`, `host_slot_id`);
this class only moves bytes. Copies are synchronous: swapping is off the decode hot path, and it
lets the device pages be reused by the same step's forward right after `swap_out` returns.
"""

from __future__ import annotations

import torch

from .cache_tensors import CacheTensors


class HostStore:
    """Host buffers shaped like `cache` with room for num_host_pages pages and num_host_slots slots.

    Args:
        cache: the device cache this store mirrors (same dtypes and per-page / per-slot shapes).
        num_host_pages / num_host_slots: capacity (SchedulerConfig.num_host_pages / num_host_slots).
        pin_memory: page-locked buffers for faster copies; None = when the cache is on a CUDA device.
    """

    def __init__(self, cache: CacheTensors, num_host_pages: int, num_host_slots: int, pin_memory: bool | None = None):
        if num_host_pages < 0 or num_host_slots < 0:
            raise ValueError(f"num_host_pages / num_host_slots: expected >= 0, got {num_host_pages} / {num_host_slots}")
        self.cache = cache
        self.num_pages = num_host_pages
        self.num_slots = num_host_slots
        if pin_memory is None:
            pin_memory = cache.device.type == "cuda" and torch.cuda.is_available()
        self.pinned = pin_memory

        def like(t: torch.Tensor, n: int) -> torch.Tensor:
            shape = (t.shape[0], n, *t.shape[2:])
            return torch.zeros(shape, dtype=t.dtype, device="cpu", pin_memory=pin_memory)

        self.mla_kv_all = like(cache.mla_kv_all, num_host_pages)  # [L_mla, host pages, page_size, width]
        self.kda_state_all = like(cache.kda_state_all, num_host_slots)  # [L_kda, host slots, H, V, K]
        self.kda_conv_all = like(cache.kda_conv_all, num_host_slots)  # [L_kda, host slots, C, W-1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.mla_kv_all, self.kda_state_all, self.kda_conv_all))

    def swap_out(self, page_ids, slot_id: int, host_page_ids, host_slot_id: int) -> None:
        """Copy device pages `page_ids` and slot `slot_id` into host pages `host_page_ids` and host slot `host_slot_id`."""
        dev, host = self._indices(page_ids, slot_id, host_page_ids, host_slot_id)
        c = self.cache
        if dev[0].numel():
            self.mla_kv_all.index_copy_(1, host[0], c.mla_kv_all.index_select(1, dev[0]).cpu())
        self.kda_state_all.index_copy_(1, host[1], c.kda_state_all.index_select(1, dev[1]).cpu())
        self.kda_conv_all.index_copy_(1, host[1], c.kda_conv_all.index_select(1, dev[1]).cpu())

    def swap_in(self, host_page_ids, host_slot_id: int, page_ids, slot_id: int) -> None:
        """Copy host pages / slot back into device pages `page_ids` and slot `slot_id` (ids may differ from swap_out's)."""
        dev, host = self._indices(page_ids, slot_id, host_page_ids, host_slot_id)
        c, d = self.cache, self.cache.device
        if dev[0].numel():
            c.mla_kv_all.index_copy_(1, dev[0], self.mla_kv_all.index_select(1, host[0]).to(d))
        c.kda_state_all.index_copy_(1, dev[1], self.kda_state_all.index_select(1, host[1]).to(d))
        c.kda_conv_all.index_copy_(1, dev[1], self.kda_conv_all.index_select(1, host[1]).to(d))

    def apply(self, swap_out=(), swap_in=()) -> None:
        """Run a step's swaps in the required order: every swap-out before any swap-in.

        Args:
            swap_out / swap_in: entries with page_ids, slot_id, host_page_ids, host_slot_id (scheduler.SwapEntry).
        """
        for e in swap_out:
            self.swap_out(e.page_ids, e.slot_id, e.host_page_ids, e.host_slot_id)
        for e in swap_in:
            self.swap_in(e.host_page_ids, e.host_slot_id, e.page_ids, e.slot_id)

    def _indices(self, page_ids, slot_id, host_page_ids, host_slot_id):
        page_ids, host_page_ids = list(page_ids), list(host_page_ids)
        if len(page_ids) != len(host_page_ids):
            raise ValueError(f"host_page_ids: {len(host_page_ids)} host pages for {len(page_ids)} device pages")
        _check(host_page_ids, self.num_pages, "host page", "host store capacity (num_host_pages)")
        _check([host_slot_id], self.num_slots, "host slot", "host store capacity (num_host_slots)")
        _check(page_ids, self.cache.num_pages, "page", "device cache")
        _check([slot_id], self.cache.num_slots, "slot", "device cache")
        dev_dev = self.cache.device
        dev = (torch.tensor(page_ids, dtype=torch.int64, device=dev_dev),
               torch.tensor([slot_id], dtype=torch.int64, device=dev_dev))
        host = (torch.tensor(host_page_ids, dtype=torch.int64), torch.tensor([host_slot_id], dtype=torch.int64))
        return dev, host


def _check(ids, limit: int, what: str, where: str) -> None:
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < limit]
    if bad:
        raise IndexError(f"{what} id {bad[0]!r} out of range: the {where} holds {limit} {what}s")
