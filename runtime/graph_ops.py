"""The ops the executor runs, by op type: the plain ONNX ops, the k3 ops that only rearrange values, the
collectives, and the dtypes a graph may name; with the check of one node against them (graph_check runs it over
a graph at load, the executor on a node it binds)."""

from __future__ import annotations

from collections.abc import Callable

import onnx
import torch
from onnx import helper

from .model_facts import KDA, MLA

K3_DOMAIN = "k3"
CACHED_OPS = {"KDA": KDA, "MLA": MLA}  # ops that take their layer's cache, found by their cache_index attribute

ONNX_TO_TORCH = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.BFLOAT16: torch.bfloat16,
                  onnx.TensorProto.FLOAT16: torch.float16, onnx.TensorProto.UINT8: torch.uint8,
                  onnx.TensorProto.INT64: torch.int64}


# k3 ops that only rearrange values (no kernel, no tactic): views, not copies
STRUCTURE_OPS: dict[str, Callable[[dict], Callable]] = {
    "SplitColumns": lambda attrs: (lambda x: x.split(list(attrs["sizes"]), dim=-1)),
    "SliceColumns": lambda attrs: (lambda x: x.narrow(-1, attrs["start"], attrs["size"])),
}
COMM_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "EPGather": "ep_gather", "EPScatter": "ep_scatter"}


def _cast(attrs: dict):
    dtype = ONNX_TO_TORCH[attrs["to"]]
    return lambda x: x.to(dtype)


ONNX_OPS: dict[str, Callable[[dict], Callable]] = {
    "Add": lambda attrs: (lambda a, b: a + b),
    "Identity": lambda attrs: (lambda x: x),
    "Cast": _cast,
}


def type_name(elem_type) -> str:
    """An ONNX element type's name (FLOAT, BFLOAT16, ...), or its repr where it names none."""
    try:
        return onnx.TensorProto.DataType.Name(elem_type)
    except (ValueError, TypeError):
        return repr(elem_type)


def op_problem(node: onnx.NodeProto, plugins: dict, caches: dict[str, int] | None = None) -> str | None:
    """What keeps the executor from binding `node` with the engine's plugin table (None: nothing); with `caches`
    (layers of each kind on the rank), also a KDA or MLA node's cache_index past them."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.domain == "":
        if node.op_type not in ONNX_OPS:
            return f"op {node.op_type} is not an ONNX op the runtime runs ({', '.join(sorted(ONNX_OPS))})"
        if node.op_type == "Cast" and attrs.get("to") not in ONNX_TO_TORCH:
            return f"Cast to element type {type_name(attrs.get('to'))}, not one the runtime reads"
        return None
    if node.domain != K3_DOMAIN or not (node.op_type in STRUCTURE_OPS or node.op_type in COMM_OPS
                                        or node.op_type in plugins):
        return f"op {node.domain}::{node.op_type} is neither a structure op nor in the engine's plugin table"
    if caches is not None and (kind := CACHED_OPS.get(node.op_type)):
        index = attrs.get("cache_index")
        if not (isinstance(index, int) and 0 <= index < caches[kind]):
            return f"cache_index {index!r}: this rank holds {caches[kind]} {kind.upper()} layer cache(s)"
    return None
