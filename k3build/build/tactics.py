"""Choose one implementation per plugin op for the target, once, and stamp the engine with it."""

from __future__ import annotations

import importlib.metadata

import torch
from k3plugins import registry

from .. import __version__

# Ops of the graph that are plugins (Add/Cast/Identity are ONNX ops; AllReduce/AllGather belong to the runtime's
# communicator, not to a plugin).
PLUGIN_OPS = ("Embedding", "LMHead", "Linear", "RMSNorm", "AttnRes", "GatedMLP", "Router", "MoEExperts", "KDA", "MLA")
TARGET_ARCH = {"cpu": "cpu", "sm90": "sm_90", "gfx942": "gfx942"}


def resolve_plugins(target: str, overrides: dict[str, str] | None = None) -> tuple[dict[str, dict], list[str]]:
    """The plugin table {op: {version, tactic}} for `target`, and notes on preferred tactics passed over.

    A preferred tactic that cannot run here (e.g. a Triton kernel without the `triton` package) falls back to
    the next one in `registry.PREFERENCE`; the note says so, because the engine then runs a slower kernel.
    Raises ValueError when an op has no implementation for the target at all (or a forced override fails).
    """
    overrides = overrides or {}
    table, notes = {}, []
    for op in PLUGIN_OPS:
        impl = registry.resolve(op, target, overrides.get(op))
        table[op] = {"version": impl.version, "tactic": impl.tactic}
        if op not in overrides:
            notes += _passed_over(op, target, impl.tactic)
    return table, notes


def _passed_over(op: str, target: str, chosen: str) -> list[str]:
    notes = []
    for tactic in registry.PREFERENCE[target]:
        if tactic == chosen:
            break
        impl = registry.find(op, tactic)
        if impl is not None:
            ok, why = impl.supports(target)
            if not ok:
                notes.append(f"{op}: using the {chosen!r} tactic on {target}, not {tactic!r} ({why})")
    return notes


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def stamp_for(target: str) -> dict:
    return {"k3build_version": __version__, "target": target, "target_arch": TARGET_ARCH[target],
            "plugin_abi": registry.PLUGIN_ABI, "torch": torch.__version__.split("+")[0], "triton": _version("triton")}
