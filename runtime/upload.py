"""Small host values onto the device without a host sync: through pinned memory, non-blocking.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the stream, that is for
every step already launched; with async scheduling, for the step in flight."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (numbers or nested lists of them, or a numpy array) as a tensor on `device`, its copy queued on the
    current stream."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
