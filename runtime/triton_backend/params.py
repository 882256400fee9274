"""The model's config.pbtxt parameters (strings) as the engine's options; a bad value names its parameter."""

from __future__ import annotations

from ..engine_flags import from_params
from ..engine_options import EngineOptions


def engine_options(params: dict[str, str]) -> EngineOptions:
    """device (default cpu) and engine_flags' options (num_pages, preemption_mode, async_scheduling ("true" /
    "false"), …); one not set is the engine's (memory plan, build limits, engine_options.resolve_async_scheduling).
    ValueError names the parameter."""
    values = from_params(params)
    try:
        return EngineOptions(device=params.get("device") or "cpu", **values)
    except ValueError as e:
        raise ValueError(f"config.pbtxt: parameters: {e}") from None
