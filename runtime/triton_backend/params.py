"""The model's config.pbtxt parameters (strings) as the engine's options; a bad value names its parameter."""

from __future__ import annotations

from ..llm_engine import EngineOptions

_BOOLS = {"true": True, "false": False}


def engine_options(params: dict[str, str]) -> EngineOptions:
    """device (default cpu), num_pages (default: the engine's memory plan), async_scheduling ("true" / "false";
    default: the engine's, see llm_engine.resolve_async_scheduling)."""
    num_pages = params.get("num_pages")
    if num_pages and not (num_pages.isdigit() and int(num_pages) > 0):
        raise ValueError(f"config.pbtxt: parameter num_pages must be a positive integer, got {num_pages!r}")
    flag = params.get("async_scheduling")
    if flag and flag.lower() not in _BOOLS:
        raise ValueError(f"config.pbtxt: parameter async_scheduling must be true or false, got {flag!r}")
    return EngineOptions(device=params.get("device") or "cpu", num_pages=int(num_pages) if num_pages else None,
                         async_scheduling=_BOOLS[flag.lower()] if flag else None)
