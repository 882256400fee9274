"""`k3build synth`: a random K3-architecture HF checkpoint, written shard by shard, tensor by tensor.

Layout is the published one (K3_SPEC.md §3): `language_model.`-prefixed names in several
`model-0000i-of-0000n.safetensors` shards, `model.safetensors.index.json`, the `kimi_k3` wrapper config.json and
a small tokenizer. Memory stays at about one tensor: each shard's header is planned first, then every tensor
is generated and written in place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zlib
from pathlib import Path

import click
import torch
from k3plugins.progress import progress_bar

from .command import writing_command
from .config import ConfigError, K3Config, _k3_layer_types, preset, to_hf_wrapper_config
from .mxfp4 import quantize_mxfp4
from .output_dir import check_free_space, check_only_ours, config_of, staged_output
from .safetensors_io import DTYPE_SIZES, TORCH_DTYPES, plan_file, pwrite_all, tensor_bytes
from .schema import PREFIX, checkpoint_tensors
from .tokenizer import write_tokenizer

INIT_STD = 0.02


def _generator(seed: int, name: str) -> torch.Generator:
    # Per-tensor seeds make every tensor independent of write order and shard count.
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))


def make_tensor(name: str, shape: tuple[int, ...], dtype: str, cfg: K3Config, seed: int) -> torch.Tensor:
    """A random value with a sensible scale for tensor `name` (unprefixed K3 name; not for MXFP4 parts)."""
    g = _generator(seed, name)
    tdtype = TORCH_DTYPES[dtype]
    if name.endswith("A_log"):
        h = cfg.kda_num_heads
        out = torch.zeros(shape, dtype=torch.float32)
        out[:h] = torch.empty(h).uniform_(1, 16, generator=g).log()  # tail stays zero, as in K3
        return out.to(tdtype)
    if name.endswith("norm.weight"):
        return (1 + 0.05 * torch.randn(shape, generator=g)).to(tdtype)
    if name.endswith("dt_bias"):
        return (0.1 * torch.randn(shape, generator=g)).to(tdtype)
    if name.endswith("e_score_correction_bias"):
        return (0.1 * torch.randn(shape, generator=g)).to(tdtype)  # nonzero so routing exercises the bias
    if "conv1d" in name:
        return (0.2 * torch.randn(shape, generator=g)).to(tdtype)
    return (INIT_STD * torch.randn(shape, generator=g)).to(tdtype)


def make_expert(prefix: str, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed, weight_scale) of one routed expert matrix of logical [rows, K]: random weights, quantized."""
    w = INIT_STD * torch.randn(shape, generator=_generator(seed, prefix))
    return quantize_mxfp4(w)


# in the config.json synth writes: what `synth --overwrite` may replace (a real checkpoint or anything else is the
# user's to remove)
SYNTH_MARK = "k3build_synth"


def synth(out_dir: str | Path, cfg: K3Config, *, seed: int = 0, num_shards: int = 2, progress: bool = True,
          overwrite: bool = False) -> Path:
    """Write a random K3 checkpoint for `cfg` as out_dir, whole or not at all (it is written beside, then renamed
    into place). An existing out_dir must be empty, or a checkpoint (a config.json) with `overwrite`; the other
    files of a replaced checkpoint go with it. Returns out_dir."""
    if num_shards < 1:
        raise ValueError(f"num_shards: expected >= 1, got {num_shards}")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):  # an empty one is taken as it is
        if not overwrite:
            raise ValueError(f"{out_dir}: already exists; pass --overwrite to replace it")
        if not (out_dir.is_dir() and config_of(out_dir).get(SYNTH_MARK)):
            raise ValueError(f"{out_dir}: not a checkpoint synth wrote, so --overwrite leaves it alone (it replaces "
                             "only synth's own output or an empty directory); remove it yourself or pick another path")
        check_only_ours(out_dir, ValueError)
    specs = checkpoint_tensors(cfg, "k3")
    sizes = {n: math.prod(shape) * DTYPE_SIZES[dtype] for n, (shape, dtype) in specs.items()}
    check_free_space(out_dir, sum(sizes.values()), ValueError)
    with staged_output(out_dir, ValueError) as staging:
        _write_checkpoint(staging, cfg, specs, sizes, seed, num_shards, progress)
    return out_dir


def _write_checkpoint(out_dir: Path, cfg: K3Config, specs: dict, sizes: dict[str, int], seed: int, num_shards: int,
                      progress: bool) -> None:
    total = sum(sizes.values())
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    acc = 0
    for n, s in sizes.items():
        shards[min(num_shards - 1, acc * num_shards // max(total, 1))].append(n)
        acc += s
    shards = [s for s in shards if s]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    bar = progress_bar(total=total, unit="B", unit_scale=True, desc="synth", enabled=progress)
    for fname, members in zip(files, shards):
        layout = plan_file([(PREFIX + n, specs[n][1], specs[n][0]) for n in members], {"format": "pt"})
        path = out_dir / fname
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, layout.size)
            pwrite_all(fd, layout.header, 0)
            pending: dict[str, torch.Tensor] = {}
            for n in members:
                shape, dtype = specs[n]
                if n.endswith(("weight_packed", "weight_scale")):
                    base = n.rsplit(".", 1)[0]
                    if n not in pending:
                        rows, packed_cols = specs[base + ".weight_packed"][0]
                        pending[base + ".weight_packed"], pending[base + ".weight_scale"] = make_expert(
                            base, (rows, packed_cols * 2), seed)
                    t = pending.pop(n)
                else:
                    t = make_tensor(n, shape, dtype, cfg, seed)
                pwrite_all(fd, tensor_bytes(t), layout.offsets[PREFIX + n])
                weight_map[PREFIX + n] = fname
                bar.update(t.numel() * t.element_size())
        finally:
            os.close(fd)
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = {**to_hf_wrapper_config(cfg), SYNTH_MARK: {"seed": seed}}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(out_dir, cfg)


@click.command("synth")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--preset", "preset_name", default="tiny", show_default=True, help="config preset (tiny, small, k3)")
@click.option("--seed", default=0, show_default=True, help="seed of the random weights")
@click.option("--shards", type=click.IntRange(min=1), default=2, show_default=True,
              help="number of safetensors shards")
@click.option("--dtype", type=click.Choice(["bf16"]), default="bf16", show_default=True,
              help="dtype of the non-quantized weights (K3 checkpoints are bf16)")
@click.option("--num-layers", type=int, default=None, help="override num_hidden_layers (K3's MLA pattern)")
@click.option("--num-experts", type=int, default=None, help="override num_experts")
@click.option("--overwrite", is_flag=True, help="replace an existing checkpoint at OUT")
@click.option("--progress/--no-progress", default=True, help="Show progress (in a log: a line every 30 s).")
def synth_cmd(out, preset_name, seed, shards, dtype, num_layers, num_experts, overwrite, progress):
    """Write a random K3 checkpoint (MXFP4 experts) to OUT."""
    with writing_command("synth", out, (ConfigError, ValueError)):
        cfg = preset(preset_name)
        if num_layers is not None:
            cfg = dataclasses.replace(cfg, num_hidden_layers=num_layers, layer_types=_k3_layer_types(num_layers))
        if num_experts is not None:
            cfg = dataclasses.replace(cfg, num_experts=num_experts,
                                      num_experts_per_token=min(cfg.num_experts_per_token, num_experts))
        synth(out, cfg, seed=seed, num_shards=shards, overwrite=overwrite, progress=progress)
    click.echo(f"wrote {out}")
