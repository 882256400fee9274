"""Walk a rank's ONNX graph and run each node with the plugin the engine chose for it.

Nodes are bound once at load (function, input names, constant attributes); a step only looks values up and
calls. KDA and MLA nodes also receive the step's sequence metadata and their layer's cache tensors, found
by the node's `cache_index` — the only state outside the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx
import torch
from k3plugins import registry
from k3plugins.step_scope import step_scope
from onnx import helper

from .graph_ops import COMM_OPS, STRUCTURE_OPS, ONNX_OPS, op_problem
from .loader import EngineError, RankEngine


@dataclass(frozen=True)
class StepBatch:
    """One step's inputs, all requests packed along tokens."""

    input_ids: torch.Tensor  # [T] int64 (first PP stage)
    cu_seqlens: torch.Tensor  # [N+1] int64, token offsets of the N scheduled sequences
    slot_ids: torch.Tensor  # [N] int64, KDA slot of each sequence
    context_lens: torch.Tensor  # [N] int64, tokens cached per sequence after this step
    page_table: torch.Tensor  # [N, max_pages] int64, -1 where unused
    logits_indices: torch.Tensor  # [M] int64, token rows whose logits are wanted
    # (new tokens, context length) of each sequence as the host scheduled them: an eager step's, so that the MLA
    # plugins pick each sequence's prefill form without reading the device; None in a CUDA graph (decode)
    host_seqs: tuple[tuple[int, int], ...] | None = None


# async scheduling: an input id FED - i (i >= 0) stands for the previous step's i-th sampled token, which is still
# on the device when the step is staged (negative, so never a real id; below the scheduler's PLACEHOLDER, -1, so
# that one left unresolved is not read as fed); feed_tokens puts it in
FED = -2


def feed_tokens(ids: torch.Tensor, fed: torch.Tensor) -> None:
    """ids [T] int64, in place on their device: each FED - i becomes fed[i], without a host sync."""
    src = (FED - ids).clamp(min=0)
    ids.copy_(torch.where(ids <= FED, fed.index_select(0, src), ids))


class Communicator:
    """Collectives by group name; a single rank's communicator is the identity (runtime/dist/comm.py: many)."""

    def all_reduce(self, x: torch.Tensor, group: str) -> torch.Tensor:
        return x

    def wait_loaded(self) -> None:
        """Return once every rank has read its weights (none to wait for here)."""

    def all_gather(self, x: torch.Tensor, group: str, axis: int) -> torch.Tensor:
        return x

    def ep_gather(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, group: str, capacity: int):
        return z, ids, weights

    def ep_scatter(self, y: torch.Tensor, z: torch.Tensor, *, group: str, capacity: int) -> torch.Tensor:
        return y

    def share_tokens(self, tokens: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Async scheduling: rank `src`'s sampled ids (or their logprobs' rows) into `tokens` on every rank (this
        rank's own here)."""
        return tokens

    def send_stage(self, hidden: torch.Tensor, blocks: list[torch.Tensor]) -> None:
        raise RuntimeError("pipeline hand-off needs the multi-rank communicator")

    def recv_stage(self, num_tokens: int, hidden_size: int, num_blocks: int, dtype: torch.dtype) -> dict:
        raise RuntimeError("pipeline hand-off needs the multi-rank communicator")


@dataclass
class _Bound:
    name: str
    fn: Callable
    inputs: list[str]
    outputs: list[str]
    attrs: dict
    kind: str  # "plain" | "kda" | "mla" | "attn_res" | "comm"


def _attn_res_inputs(ins: list[str], attrs: dict) -> list[str]:
    """An AttnRes node's inputs in one order for every variant, (partial, proj, norm, delta, out_norm,
    *snapshots) with "" (None) for the absent ones: delta with residual=1 (the residual add fused), out_norm with
    norm=1 (the next RMSNorm fused); those attributes and norm_eps are consumed here. Graph order is (partial,
    [delta if residual], proj, norm, [out_norm if norm], *snapshots): the variadic inputs come last in ONNX."""
    residual, norm = attrs.pop("residual", 0), attrs.pop("norm", 0)
    partial, rest = ins[0], ins[1:]
    delta = rest.pop(0) if residual else ""
    proj, res_norm = rest[:2]
    out_norm = rest[2] if norm else ""
    if norm:
        attrs["out_eps"] = attrs.pop("norm_eps")
    return [partial, proj, res_norm, delta, out_norm, *rest[2 + norm:]]


def _attrs(node: onnx.NodeProto) -> dict:
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


class Executor:
    def __init__(self, engine: RankEngine, caches, comm: Communicator | None = None):
        """Args: caches: has `kda_state[i]`, `kda_conv[i]`, `mla_kv[i]` per local KDA / MLA layer index."""
        self.engine, self.caches, self.comm = engine, caches, comm or Communicator()
        self.weights = engine.weights
        plugins = engine.build["plugins"]
        self.outputs = [o.name for o in engine.graph.output]
        self.nodes = [self._bind(n, plugins) for n in engine.graph.node]

    def _bind(self, node: onnx.NodeProto, plugins: dict) -> _Bound:
        why = op_problem(node, plugins)  # load checked the whole graph; a RankEngine made otherwise is not
        if why:  # an op of a newer k3build, or a graph edited by hand
            raise EngineError(f"graph node {node.name!r}: {why}; rebuild the engine with this k3build")
        attrs = _attrs(node)
        ins, outs = list(node.input), list(node.output)
        if node.domain == "":
            return _Bound(node.name, ONNX_OPS[node.op_type](attrs), ins, outs, {}, "plain")
        if node.op_type in STRUCTURE_OPS:
            return _Bound(node.name, STRUCTURE_OPS[node.op_type](attrs), ins, outs, {}, "plain")
        if node.op_type in COMM_OPS:
            return _Bound(node.name, getattr(self.comm, COMM_OPS[node.op_type]), ins, outs, attrs, "comm")
        fn = registry.find(node.op_type, plugins[node.op_type]["tactic"]).load()
        kind = {"KDA": "kda", "MLA": "mla", "AttnRes": "attn_res"}.get(node.op_type, "plain")
        if kind == "attn_res":
            ins = _attn_res_inputs(ins, attrs)
        if node.op_type in ("Router", "MoEInProj"):
            attrs["renormalize"] = bool(attrs["renormalize"])
        return _Bound(node.name, fn, ins, outs, attrs, kind)

    @torch.inference_mode()
    def run(self, batch: StepBatch, extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Run the graph for one step. Returns the graph outputs (logits [M, V] fp32 on the last stage)."""
        with step_scope():  # the plugins derive the batch's index tensors once, not once a layer
            return self._run(batch, extra)

    def _run(self, batch: StepBatch, extra: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        env = dict(self.weights)
        env.update({"input_ids": batch.input_ids, "logits_indices": batch.logits_indices, **(extra or {})})
        env[""] = None
        for b in self.nodes:
            args = [env[i] for i in b.inputs]
            if b.kind == "kda":
                ci = b.attrs["cache_index"]
                kw = {k: v for k, v in b.attrs.items() if k != "cache_index"}
                kw.setdefault("lower_bound", None)
                out = b.fn(*args, self.caches.kda_state[ci], self.caches.kda_conv[ci], cu_seqlens=batch.cu_seqlens,
                           slot_ids=batch.slot_ids, **kw)
            elif b.kind == "mla":
                ci = b.attrs["cache_index"]
                kw = {k: v for k, v in b.attrs.items() if k != "cache_index"}
                if batch.host_seqs is not None:
                    kw["host_seqs"] = batch.host_seqs
                out = b.fn(*args, self.caches.mla_kv[ci], cu_seqlens=batch.cu_seqlens,
                           context_lens=batch.context_lens, page_table=batch.page_table, **kw)
            elif b.kind == "attn_res":
                # bound as (partial, proj, norm, delta, out_norm, *snapshots); the snapshots go as a list: the
                # device kernel reads them in place (the reference stacks them)
                out = b.fn(args[0], args[5:], args[1], args[2], delta=args[3], out_norm=args[4], **b.attrs)
            else:
                out = b.fn(*args, **b.attrs)
            if len(b.outputs) == 1:
                env[b.outputs[0]] = out
            else:
                env.update(zip(b.outputs, out))
        return {name: env[name] for name in self.outputs}
