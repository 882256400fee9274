"""Host copies of swapped-out requests: their MLA pages and KDA slot, bit-exact.

Host page and slot ids are booked by the scheduler (`SwapEntry.host_page_ids`, `host_slot_id`);
this class only moves bytes. The host buffers are page- and slot-major (a host page holds its rows of every
layer, one block), so that on a GPU each copy is one DMA between the device and page-locked memory, queued on the
current stream without a host sync: a step's forward, queued after, reuses the device pages only once the
copies are done, and a later swap-in of the same host page reads it only once its swap-out is done. The host
must synchronize before reading the buffers itself.
"""

from __future__ import annotations

import torch

from ..upload import to_device
from .cache_tensors import CacheTensors


class HostStore:
    """Host buffers with room for num_host_pages pages and num_host_slots slots of `cache`.

    Attributes:
        mla_kv: [host pages, L_mla, page_size, width] (the cache's mla_kv_all with its first two dims swapped)
        kda_state: [host slots, L_kda, H, V, K]; kda_conv: [host slots, L_kda, C, W-1] (likewise)

    Args:
        cache: the device cache this store mirrors (same dtypes and per-page / per-slot shapes).
        num_host_pages / num_host_slots: capacity (SchedulerConfig.num_host_pages / num_host_slots).
        pin_memory: page-locked buffers, for copies that do not stop the host; None = when the cache is on a CUDA
            device.
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
            return torch.zeros((n, t.shape[0], *t.shape[2:]), dtype=t.dtype, device="cpu", pin_memory=pin_memory)

        self.mla_kv = like(cache.mla_kv_all, num_host_pages)
        self.kda_state = like(cache.kda_state_all, num_host_slots)
        self.kda_conv = like(cache.kda_conv_all, num_host_slots)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.mla_kv, self.kda_state, self.kda_conv))

    def swap_out(self, page_ids, slot_id: int, host_page_ids, host_slot_id: int) -> None:
        """Copy device pages `page_ids` and slot `slot_id` into host pages `host_page_ids` and host slot `host_slot_id`."""
        page_ids, host_page_ids = self._ids(page_ids, slot_id, host_page_ids, host_slot_id)
        c = self.cache
        if page_ids:
            # the pages gathered page-major on the device, then copied out a run of consecutive host pages at a time
            rows = c.mla_kv_all.index_select(1, to_device(page_ids, c.device)).transpose(0, 1).contiguous()
            for i, h, n in _runs(host_page_ids):
                self.mla_kv[h:h + n].copy_(rows[i:i + n], non_blocking=self.pinned)
        self.kda_state[host_slot_id].copy_(c.kda_state_all[:, slot_id], non_blocking=self.pinned)
        self.kda_conv[host_slot_id].copy_(c.kda_conv_all[:, slot_id], non_blocking=self.pinned)

    def swap_in(self, host_page_ids, host_slot_id: int, page_ids, slot_id: int) -> None:
        """Copy host pages / slot back into device pages `page_ids` and slot `slot_id` (ids may differ from swap_out's)."""
        page_ids, host_page_ids = self._ids(page_ids, slot_id, host_page_ids, host_slot_id)
        c = self.cache
        if page_ids:
            rows = torch.empty((len(page_ids), *self.mla_kv.shape[1:]), dtype=self.mla_kv.dtype, device=c.device)
            for i, h, n in _runs(host_page_ids):
                rows[i:i + n].copy_(self.mla_kv[h:h + n], non_blocking=self.pinned)
            c.mla_kv_all.index_copy_(1, to_device(page_ids, c.device), rows.transpose(0, 1))
        c.kda_state_all[:, slot_id].copy_(self.kda_state[host_slot_id], non_blocking=self.pinned)
        c.kda_conv_all[:, slot_id].copy_(self.kda_conv[host_slot_id], non_blocking=self.pinned)

    def apply(self, swap_out=(), swap_in=()) -> None:
        """Queue a step's swaps in the required order: every swap-out before any swap-in.

        Args:
            swap_out / swap_in: entries with page_ids, slot_id, host_page_ids, host_slot_id (scheduler.SwapEntry).
        """
        for e in swap_out:
            self.swap_out(e.page_ids, e.slot_id, e.host_page_ids, e.host_slot_id)
        for e in swap_in:
            self.swap_in(e.host_page_ids, e.host_slot_id, e.page_ids, e.slot_id)

    def _ids(self, page_ids, slot_id, host_page_ids, host_slot_id) -> tuple[list[int], list[int]]:
        page_ids, host_page_ids = list(page_ids), list(host_page_ids)
        if len(page_ids) != len(host_page_ids):
            raise ValueError(f"host_page_ids: {len(host_page_ids)} host pages for {len(page_ids)} device pages")
        _check(host_page_ids, self.num_pages, "host page", "host store capacity (num_host_pages)")
        _check([host_slot_id], self.num_slots, "host slot", "host store capacity (num_host_slots)")
        _check(page_ids, self.cache.num_pages, "page", "device cache")
        _check([slot_id], self.cache.num_slots, "slot", "device cache")
        return page_ids, host_page_ids


def _runs(ids: list[int]):
    """(position, first id, length) of each run of consecutive ids in `ids`: [4, 5, 6, 1, 2] gives (0, 4, 3) and
    (3, 1, 2)."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            yield start, ids[start], i - start
            start = i


def _check(ids, limit: int, what: str, where: str) -> None:
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < limit]
    if bad:
        raise IndexError(f"{what} id {bad[0]!r} out of range: the {where} holds {limit} {what}s")
