"""The multiprocessor count of a kernel's device, which several launches size themselves by (cached per device)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (0 elsewhere: the interpreter, where no cap or bound applies)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
