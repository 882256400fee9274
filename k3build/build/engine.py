"""`build`: converted checkpoint -> engine dir (DESIGN.md "Engine dir").

ENGINE/config.json  {version, pretrained_config, mapping, build_config, stamp, ranks, memory_plan}
ENGINE/rank{N}/graph.onnx, ENGINE/rank{N}/weights.safetensors, tokenizer files.
Written into a temporary sibling directory and renamed into place, so an interrupted build leaves nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import onnx
import torch
from safetensors import safe_open
from tqdm import tqdm

from .. import __version__
from ..config import K3Config
from ..mapping import Mapping
from . import graph as graph_mod
from .layout import engine_tensors
from .options import DTYPES, BuildOptions
from .st_writer import SafetensorsWriter
from .tactics import resolve_plugins, stamp_for

ENGINE_FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


class BuildError(RuntimeError):
    """The build cannot proceed; the message says why and what to change."""


def read_converted(converted_dir: Path) -> tuple[dict, K3Config, Mapping]:
    path = converted_dir / "config.json"
    if not path.exists():
        raise BuildError(f"{converted_dir}: not a converted checkpoint (no config.json); run `k3build convert` first")
    raw = json.loads(path.read_text())
    if "mapping" not in raw:
        raise BuildError(f"{path}: no 'mapping' field; this looks like an HF checkpoint — run `k3build convert` on it first")
    cfg = K3Config.from_dict({k: v for k, v in raw.items() if k not in ("mapping", "source")})
    mapping = Mapping.from_dict(raw["mapping"])
    for rank in range(mapping.world_size):
        if not (converted_dir / f"rank{rank}.safetensors").exists():
            raise BuildError(f"{converted_dir}/rank{rank}.safetensors: missing (mapping has world_size {mapping.world_size})")
    return raw, cfg, mapping


def build(converted_dir: str | os.PathLike, engine_dir: str | os.PathLike, options: BuildOptions, *,
          overwrite: bool = False, progress: bool = True) -> Path:
    converted_dir, engine_dir = Path(converted_dir), Path(engine_dir)
    _, cfg, mapping = read_converted(converted_dir)
    if engine_dir.exists() and not overwrite:
        raise BuildError(f"{engine_dir}: already exists (pass --overwrite to replace it)")
    if mapping.attention_dp and mapping.world_size > 1:
        raise BuildError("attention-DP engines need the token exchange of the multi-rank runtime, which this "
                         "version does not have yet; build with attention-DP off")
    memory_plan = _memory_plan(cfg, mapping, options)
    plugins = resolve_plugins(options.target)
    engine_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{engine_dir.name}.tmp-", dir=engine_dir.parent))
    try:
        ranks = {}
        for rank in range(mapping.world_size):
            ranks[str(rank)] = _build_rank(cfg, mapping, rank, converted_dir, tmp, options, progress)
        for name in TOKENIZER_FILES:
            if (converted_dir / name).exists():
                shutil.copy2(converted_dir / name, tmp / name)
        config = {
            "version": ENGINE_FORMAT_VERSION,
            "pretrained_config": cfg.to_dict(),
            "mapping": mapping.to_dict(),
            "build_config": {**options.to_dict(), "plugins": plugins},
            "stamp": stamp_for(options.target),
            "ranks": ranks,
            "memory_plan": memory_plan,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; an engine is meant to be shared
        if engine_dir.exists():
            shutil.rmtree(engine_dir)
        os.replace(tmp, engine_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return engine_dir


def _build_rank(cfg: K3Config, mapping: Mapping, rank: int, converted_dir: Path, out: Path, options: BuildOptions,
                progress: bool) -> dict:
    rank_dir = out / f"rank{rank}"
    rank_dir.mkdir()
    writer = SafetensorsWriter(rank_dir / "weights.safetensors", metadata={"format": "k3engine", "rank": str(rank)})
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    src_path = converted_dir / f"rank{rank}.safetensors"
    with safe_open(src_path, framework="pt") as src:
        keys = set(src.keys())

        def get(name: str) -> torch.Tensor:
            if name not in keys:
                raise BuildError(f"{src_path}: tensor {name!r} missing (needed by the layout pass for rank {rank})")
            return src.get_tensor(name)

        layers = mapping.rank_layers(rank, cfg.num_hidden_layers)
        bar = tqdm(total=len(layers), desc=f"build rank{rank}", unit="layer", disable=not progress)
        last_layer = None
        try:
            for name, t in engine_tensors(cfg, mapping, rank, get, options.torch_dtype):
                writer.add(name, t)
                shapes[name] = (tuple(t.shape), t.dtype)
                layer = name.split(".", 1)[0]
                if layer != last_layer and layer[1:].isdigit():
                    bar.update(1)
                    last_layer = layer
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
    writer.close()
    model = graph_mod.build_graph(cfg, mapping, rank, shapes, options.torch_dtype)
    onnx.save(model, rank_dir / "graph.onnx")
    return {
        "pp_rank": mapping.pp_rank(rank), "tp_rank": mapping.tp_rank(rank), "layers": [layers.start, layers.stop],
        "experts": _range(mapping.local_experts(rank, cfg.num_experts)), "tp_group": mapping.tp_group(rank),
        "pp_group": mapping.pp_group(rank), "moe_group": mapping.tp_group(rank),
        "first_stage": mapping.is_first_stage(rank), "last_stage": mapping.is_last_stage(rank),
        "weight_bytes": (rank_dir / "weights.safetensors").stat().st_size,
    }


def _range(r: range) -> list[int]:
    return [r.start, r.stop]


def _memory_plan(cfg: K3Config, mapping: Mapping, options: BuildOptions) -> dict:
    """Cache sizes the runtime starts with, and a refusal when the limits cannot fit the budget."""
    pages_per_seq = math.ceil(options.max_seq_len / options.page_size)
    plan = {"num_slots": options.max_batch_size, "num_pages": options.max_batch_size * pages_per_seq,
            "page_size": options.page_size}
    if options.gpu_memory_gib is None:
        return plan
    from ..memory import plan_memory

    mp = plan_memory(cfg, mapping, gpu_memory_bytes=int(options.gpu_memory_gib * 2**30),
                     max_seq_len=options.max_seq_len, max_batch_size=options.max_batch_size,
                     max_num_tokens=options.max_num_tokens,
                     kv_dtype_bytes=DTYPES[options.kv_dtype].itemsize,
                     state_dtype=options.state_dtype)
    if not mp.fits:
        raise BuildError(f"the engine does not fit in {options.gpu_memory_gib} GiB per rank: {mp.reason}")
    return {**plan, "budget": mp.to_dict()}
