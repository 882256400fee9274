"""Shared helpers for the converter tests: make checkpoints, corrupt them, reassemble converted ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3build.config import preset
from k3build.synth import synth

PREFIX = "language_model."


def make_tiny(path: Path, seed: int = 0, num_shards: int = 3) -> Path:
    return synth(path, preset("tiny"), seed=seed, num_shards=num_shards, progress=False)


def source_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint by unprefixed name."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for k, v in load_file(f).items():
            out[k[len(PREFIX):] if k.startswith(PREFIX) else k] = v
    return out


def reassemble(out_dir: Path) -> dict[str, torch.Tensor]:
    """Union of all ranks' slices per canonical name; asserts full coverage and that replicas agree."""
    cfg = json.loads((out_dir / "config.json").read_text())
    world = cfg["mapping"]["world_size"]
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for r in range(world):
        path = out_dir / f"rank{r}.safetensors"
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            assert meta["k3_rank"] == str(r) and meta["k3_world_size"] == str(world)
            slices = json.loads(meta["k3_slices"])
            assert set(slices) == set(f.keys())
            for name, s in slices.items():
                t = f.get_tensor(name)
                if name not in full:
                    full[name] = torch.zeros(s["shape"], dtype=t.dtype)
                    covered[name] = torch.zeros(s["shape"], dtype=torch.bool)
                dst = full[name] if s["dim"] is None else full[name].narrow(s["dim"], s["start"], s["stop"] - s["start"])
                cov = covered[name] if s["dim"] is None else covered[name].narrow(s["dim"], s["start"], s["stop"] - s["start"])
                assert tuple(dst.shape) == tuple(t.shape), name
                if cov.any():  # a replica: must equal what another rank holds
                    assert torch.equal(dst, t), name
                dst.copy_(t)
                cov.fill_(True)
    for name, cov in covered.items():
        assert cov.all(), f"{name}: not every element is on some rank"
    return full


def rewrite_shard(ckpt: Path, edit, name: str) -> str:
    """Apply `edit(dict[str, Tensor]) -> dict` to the shard holding tensor `name`; keep the index in step."""
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    fname = index["weight_map"][name]
    tensors = edit(load_file(ckpt / fname))
    save_file(tensors, ckpt / fname, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != fname}
    index["weight_map"].update({k: fname for k in tensors})
    index_path.write_text(json.dumps(index))
    return fname


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
