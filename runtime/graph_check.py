"""Check a rank's graph at load, before any weight is read: a valid ONNX model (onnx.checker, which passes the k3
domain's nodes through) that the executor can bind, node by node. A damaged or edited graph is then refused naming
the node or field, not by a KeyError or an IndexError at the first step. Cheap: the graph holds no tensor data."""

from __future__ import annotations

import onnx
from onnx import helper

from .graph_ops import CACHED_OPS, K3_DOMAIN, ONNX_TO_TORCH, op_problem, type_name
from .model_facts import KDA, MLA, ModelFacts, dense_tp


def graph_problem(model: onnx.ModelProto, cfg: dict, rank: int) -> str | None:
    """None when the executor can run `model` as `rank` of the engine whose config.json is `cfg` (already checked
    by check_engine_fields); else what is wrong, naming the node or field."""
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        return f"not a valid ONNX graph (onnx.checker: {' '.join(str(e).split())})"
    graph, info = model.graph, cfg["ranks"][str(rank)]
    if graph.name != f"k3_rank{rank}":  # the builder names each rank's graph after its rank
        return f"holds the graph {graph.name!r}, not rank {rank}'s (k3_rank{rank}): rank directories mixed up?"
    return (_inputs_problem(graph, cfg, info) or _nodes_problem(graph, cfg, info) or _outputs_problem(graph, info)
            or _dtype_problem(graph, cfg, info))


def _is_data(vi: onnx.ValueInfoProto) -> bool:
    """A step's input (symbolic dims), bound per step; the others are weights (loader._weights_problem: same rule)."""
    return any(d.dim_param for d in vi.type.tensor_type.shape.dim)


def _inputs_problem(graph: onnx.GraphProto, cfg: dict, info: dict) -> str | None:
    """The step inputs the runner feeds this rank (RankRunner.run), the weights' element types, and the vocabulary
    rows of the embedding and LM head (split over the dense TP ranks) against vocab_size."""
    blocks = sum(vi.name.startswith("blocks_in.") for vi in graph.input)
    fed = {"input_ids", "logits_indices"}
    if not info["first_stage"]:
        fed |= {"hidden_in", *(f"blocks_in.{i}" for i in range(blocks))}
    mapping, vocab = cfg["mapping"], cfg["pretrained_config"]["vocab_size"]
    tp = dense_tp(mapping)
    for vi in graph.input:
        t = vi.type.tensor_type
        if _is_data(vi):
            if vi.name not in fed:
                return f"graph input {vi.name!r}: not one the runtime feeds this rank ({', '.join(sorted(fed))})"
        elif t.elem_type not in ONNX_TO_TORCH:
            return (f"graph input {vi.name!r}: element type {type_name(t.elem_type)} is not one the runtime reads "
                    f"({', '.join(map(type_name, ONNX_TO_TORCH))})")
        elif vi.name in ("embed", "lm_head") and (rows := _rows(t)) * tp != vocab:
            return (f"graph input {vi.name!r}: {rows} vocabulary rows on each of {tp} rank(s), but "
                    f"pretrained_config.vocab_size is {vocab}")
    return None


def _rows(t: onnx.TypeProto.Tensor) -> int:
    return t.shape.dim[0].dim_value if t.shape.dim else 0


def _nodes_problem(graph: onnx.GraphProto, cfg: dict, info: dict) -> str | None:
    """Each node's op is one the executor binds (Executor._bind), its inputs are bound when it runs, and a KDA or
    MLA node's cache_index names one of this rank's layers of its kind."""
    plugins, types = cfg["build_config"]["plugins"], cfg["pretrained_config"]["layer_types"]
    start, stop = info["layers"]
    caches = {kind: sum(types[i] == kind for i in range(start, stop)) for kind in (KDA, MLA)}
    bound = {"", *(vi.name for vi in graph.input)}  # "": an optional input left out
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in graph.input if not _is_data(vi)}
    for node in graph.node:
        why = op_problem(node, plugins, caches)
        unbound = [i for i in node.input if i not in bound]
        if unbound and not why:
            why = f"input {unbound[0]!r} is no graph input nor an earlier node's output"
        why = why or _cache_problem(node, shapes, cfg)
        if why:
            return f"graph node {node.name!r}: {why}"
        bound.update(node.output)
    return None


def _cache_problem(node: onnx.NodeProto, shapes: dict[str, list[int]], cfg: dict) -> str | None:
    """A KDA or MLA node whose layer does not fit the cache the runtime sizes from config.json's pretrained_config
    (RankEngine.cache_config): the plugin would refuse its cache at the first step, after the engine had started."""
    if node.domain != K3_DOMAIN or node.op_type not in CACHED_OPS:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    model, facts = cfg["pretrained_config"], ModelFacts.from_pretrained_config(cfg["pretrained_config"])
    if node.op_type == "KDA":
        tp = dense_tp(cfg["mapping"])
        want = (facts.kda_num_heads // tp, facts.kda_head_dim, facts.kda_conv_size)
        conv = shapes.get(node.input[2]) if len(node.input) > 2 else None
        have = (attrs.get("num_heads"), attrs.get("head_dim"), conv[-1] if conv else want[2])
        if have != want:
            return (f"{have[0]} heads of {have[1]} with a conv of width {have[2]}, but the KDA cache config.json "
                    f"sizes holds {want[0]} heads of {want[1]} (pretrained_config.kda_num_heads "
                    f"{facts.kda_num_heads} over {tp} rank(s), kda_head_dim) and a conv of width {want[2]} "
                    "(kda_conv_size)")
        return None
    norm = shapes.get(node.input[4]) if len(node.input) > 4 else None
    width = facts.mla_cache_width
    have = (norm[0] if norm else model["kv_lora_rank"]) + attrs.get("qk_rope_head_dim", -1)
    if have != width:
        return (f"caches {have} values a token (its kv_a_norm's rank + qk_rope_head_dim), but the MLA cache "
                f"config.json sizes holds {width} (pretrained_config.kv_lora_rank + qk_rope_head_dim)")
    return None


_BUILD_DTYPES = {"fp32": onnx.TensorProto.FLOAT, "bf16": onnx.TensorProto.BFLOAT16, "fp16": onnx.TensorProto.FLOAT16}


def _dtype_problem(graph: onnx.GraphProto, cfg: dict, info: dict) -> str | None:
    """build_config.dtype against the dtype the graph (and so the weights: loader._weights_problem) was built in:
    the runtime sizes the KDA conv cache and the stage buffers by it, so an edited one ran the model in another
    dtype without a word. The first stage's embedding is cast to it by the build; a later stage's hidden_in is
    declared in it."""
    want = cfg["build_config"]["dtype"]
    anchor = "embed" if info["first_stage"] else "hidden_in"
    vi = next((vi for vi in graph.input if vi.name == anchor), None)
    if vi is None or vi.type.tensor_type.elem_type == _BUILD_DTYPES[want]:
        return None  # no embed on a first stage: _nodes_problem names it
    have = vi.type.tensor_type.elem_type
    built = next((k for k, v in _BUILD_DTYPES.items() if v == have), type_name(have))
    what = "weight" if anchor == "embed" else "stage input"
    return (f"{what} {anchor!r} is {built} ({type_name(have)}), but config.json's build_config.dtype, the dtype "
            f"the runtime runs the model in, is {want}: one of the two was edited after the build")


def _outputs_problem(graph: onnx.GraphProto, info: dict) -> str | None:
    """The outputs the runner reads: the logits on the last stage, else the hidden state and the snapshots it
    hands to the next stage (RankRunner._send_on)."""
    outputs = [o.name for o in graph.output]
    if info["last_stage"]:
        wanted = ["logits"]
    else:
        wanted = ["hidden_out", *(f"blocks_out.{i}" for i in range(len(outputs) - 1))]
    missing = [name for name in wanted if name not in outputs]
    if missing:
        return f"graph outputs {outputs}: the runtime reads {', '.join(map(repr, missing))} from this rank"
    made = {"", *(vi.name for vi in graph.input), *(o for node in graph.node for o in node.output)}
    unmade = [name for name in outputs if name not in made]
    return f"graph output {unmade[0]!r} is no node's output" if unmade else None
