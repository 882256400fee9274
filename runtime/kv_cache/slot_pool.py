"""Free-list bookkeeping for the KDA state slot pool (no tensors).

One slot per live request holds its recurrent state [H, V, K] and the last W-1 conv inputs of every
local KDA layer. A slot handed out again must be zeroed by the executor (`StepPlan.reset_slot_ids`).
"""

from __future__ import annotations

from collections import deque


class SlotPool:
    """Slot ids 0..num_slots-1. `allocate()` returns None when all are taken; double free asserts."""

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots: expected an int >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        """Returns: a free slot id, or None when none is free."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and self._used[slot], f"slot {slot} freed twice or never allocated"
        self._used[slot] = False
        self._free.append(slot)
