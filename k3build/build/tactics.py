"""Choose one implementation per plugin op for the target, once, and stamp the engine with it."""

from __future__ import annotations

import importlib.metadata

import torch
from k3plugins import registry
from k3plugins.moe.mxfp4 import STRIDE_BLOCK_K, W4_MAX_SCALE_BYTE, W4_TACTICS

from .. import __version__

# Ops of the graph that are plugins (Add/Cast/Identity are ONNX ops; AllReduce/AllGather belong to the runtime's
# communicator, not to a plugin).
PLUGIN_OPS = ("Embedding", "LMHead", "Linear", "RMSNorm", "AttnRes", "GatedMLP", "Router", "MoEInProj", "MoEExperts",
              "MoEOutProj", "KDA", "MLA")
TARGET_ARCH = {"cpu": "cpu", "sm90": "sm_90", "gfx942": "gfx942"}


def resolve_plugins(target: str, overrides: dict[str, str] | None = None, quantization: str = "mxfp4",
                    dtype: str = "bf16") -> tuple[dict[str, dict], list[str]]:
    """The plugin table {op: {version, tactic}} for `target`, and notes on preferred tactics passed over.

    A preferred tactic that cannot run here (e.g. a Triton kernel without the `triton` package) falls back to
    the next one in `registry.PREFERENCE`; the note says so, because the engine then runs a slower kernel.
    Raises ValueError when an op has no implementation for the target at all (or a forced override fails).
    """
    overrides = overrides or {}
    table, notes = {}, []
    for op in PLUGIN_OPS:
        impl = registry.resolve(op, target, overrides.get(op), quantization, dtype)
        table[op] = {"version": impl.version, "tactic": impl.tactic}
        if op not in overrides:
            notes += _passed_over(op, target, impl.tactic, quantization, dtype)
    return table, notes


def fit_moe_tactic(table: dict[str, dict], expert_dims: tuple[int, int], max_scale_byte: int | None, *,
                   latent: bool) -> list[str]:
    """Step the MoE tactic down to one that reads these experts exactly (edits `table`; returns notes saying why).

    triton_l reads its activations in lane_mxfp4's K order, which the build gives the latent down-projection's
    rows: without a latent projection (`latent` False) the experts read the hidden state itself, so triton_p.
    expert_dims are one rank's (input width, intermediate / moe_tp_size): what the layout pass relays.
    Tactics reading a relaid expert layout (triton_l, triton_s, triton_p) read K tiles of STRIDE_BLOCK_K: both expert
    dims (input width, intermediate) must be multiples of it, else triton. The W4 decodes are exact for E8M0 scale
    bytes up to W4_MAX_SCALE_BYTE: past it, triton_ds.
    """
    moe, notes = table.get("MoEExperts"), []
    if moe is None:
        return notes
    if moe["tactic"] == "triton_l" and not latent:
        notes.append("MoEExperts: using the 'triton_p' tactic, not 'triton_l' (it reads activations in a K order the "
                     "build gives the latent down-projection; this MoE has none)")
        record_tactic(moe, "MoEExperts", "triton_p")
    if expert_layout(table) != "natural" and any(d % STRIDE_BLOCK_K for d in expert_dims):
        notes.append(f"MoEExperts: using the 'triton' tactic, not {moe['tactic']!r} (expert dims {expert_dims} are "
                     f"not multiples of its K tile {STRIDE_BLOCK_K})")
        record_tactic(moe, "MoEExperts", "triton")
    if moe["tactic"] in W4_TACTICS and max_scale_byte is not None and max_scale_byte > W4_MAX_SCALE_BYTE:
        notes.append(f"MoEExperts: using the 'triton_ds' tactic, not {moe['tactic']!r} (an expert scale byte is "
                     f"{max_scale_byte}; the W4 decode is exact up to {W4_MAX_SCALE_BYTE})")
        record_tactic(moe, "MoEExperts", "triton_ds")
    return notes


def fit_mla_tactic(table: dict[str, dict], heads: int, latent: int, rope: int) -> list[str]:
    """Step the MLA tactic down from gluon to triton where its kernel never runs (edits `table`; returns the note):
    a rank's heads under one 64-head block, or cache rows it does not take. Its mixer would fall back to the Triton
    kernel anyway; the engine then records what runs."""
    mla = table.get("MLA")
    if mla is None or mla["tactic"] != "gluon":
        return []
    from k3plugins.mla.gluon_sm90 import BLOCK_H, LATENT_WIDTHS, ROPE_WIDTH
    if heads >= BLOCK_H and latent in LATENT_WIDTHS and rope == ROPE_WIDTH:
        return []
    record_tactic(mla, "MLA", "triton")
    return [f"MLA: using the 'triton' tactic, not 'gluon' (its kernel takes {BLOCK_H} heads a rank or more, latent "
            f"{' or '.join(map(str, LATENT_WIDTHS))} and rope {ROPE_WIDTH}; this rank has {heads} heads, latent "
            f"{latent}, rope {rope})"]


def record_tactic(entry: dict, op: str, tactic: str) -> None:
    """Point a plugin-table entry at another tactic, with that implementation's version."""
    entry.update(tactic=tactic, version=registry.find(op, tactic).version)


def expert_layout(table: dict[str, dict]) -> str:
    """How the build lays out the MXFP4 expert bytes: what the recorded MoE tactic reads."""
    moe = table.get("MoEExperts")
    impl = registry.find("MoEExperts", moe["tactic"]) if moe else None
    return impl.expert_layout if impl else "natural"


def _passed_over(op: str, target: str, chosen: str, quantization: str, dtype: str) -> list[str]:
    """Why `op` runs `chosen` on `target`: each preferred tactic it could not take, or, for a GPU target's torch
    reference, that none of the op's kernels is registered there."""
    notes = []
    for tactic in registry.PREFERENCE[target]:
        if tactic == chosen:
            break
        impl = registry.find(op, tactic)
        if impl is not None:
            ok, why = impl.supports(target, quantization, dtype)
            if not ok:
                notes.append(f"{op}: using the {chosen!r} tactic on {target}, not {tactic!r} ({why})")
    kernels = [i.tactic for i in registry.IMPLS if i.op == op and i.tactic != "reference"]
    if chosen == "reference" and target != "cpu" and kernels and not notes:
        notes.append(f"{op}: the torch reference on {target}, a slow fallback: its kernels ({', '.join(kernels)}) "
                     f"are not registered for {target}")
    return notes


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def stamp_for(target: str) -> dict:
    return {"k3build_version": __version__, "target": target, "target_arch": TARGET_ARCH[target],
            "plugin_abi": registry.PLUGIN_ABI, "torch": torch.__version__.split("+")[0], "triton": _version("triton")}
