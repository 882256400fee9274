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


def resolve_plugins(target: str, overrides: dict[str, str] | None = None) -> dict[str, dict]:
    overrides = overrides or {}
    table = {}
    for op in PLUGIN_OPS:
        impl = registry.resolve(op, target, overrides.get(op))
        table[op] = {"version": impl.version, "tactic": impl.tactic}
    return table


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def stamp_for(target: str) -> dict:
    return {"k3build_version": __version__, "target": target, "target_arch": TARGET_ARCH[target],
            "plugin_abi": registry.PLUGIN_ABI, "torch": torch.__version__.split("+")[0], "triton": _version("triton")}
