"""Converter, first half: open a source checkpoint, validate every header against the schema, plan the jobs.

Nothing here reads tensor data; every check that headers alone can answer happens before a byte is written.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, K3Config, QuantConfig
from .mapping import Mapping, MappingError
from .safetensors_io import E8M0, SafetensorsError, TensorInfo, read_header
from .schema import (IGNORED, U8, SchemaError, checkpoint_tensors, detect_flavour, dtype_matches, strip_prefix,
                     to_canonical_name)

INDEX = "model.safetensors.index.json"


# what `k3build convert` writes in its config.json "format", with the version of that format
FORMAT_NAME = "k3-converted"
FORMAT = f"{FORMAT_NAME}/1"


class ConvertError(ValueError):
    """Anything wrong with the input or the request; the message names file, tensor and expectation."""


@dataclass(frozen=True)
class Source:
    """A validated source checkpoint: tensors keyed by unprefixed source name."""

    path: Path
    cfg: K3Config
    raw_config: dict[str, Any]
    flavour: str
    tensors: dict[str, TensorInfo]


@dataclass(frozen=True, slots=True)
class Output:
    name: str  # canonical
    dtype: str
    shape: tuple[int, ...]  # full canonical shape


@dataclass(frozen=True, slots=True)
class Job:
    """One unit of work: read `sources`, validate, transform by `kind`, write `outputs`' slices."""

    kind: str  # "copy" | "quantize" (float expert -> MXFP4) | "dequantize" (MXFP4 expert -> BF16)
    sources: tuple[TensorInfo, ...]
    outputs: tuple[Output, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sources)


def open_source(ckpt_dir: str | Path) -> Source:
    """Read config and all shard headers of a checkpoint and check them against the schema."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise ConvertError(f"{path}: not a checkpoint directory")
    try:
        raw = json.loads((path / "config.json").read_text())
        if isinstance(raw, dict) and str(raw.get("format", "")).startswith(FORMAT_NAME + "/"):
            raise ConvertError(f"{path}: already a converted checkpoint (convert takes a Hugging Face one); build "
                               f"an engine from it with `k3build build {path} ENGINE_DIR`")
        if isinstance(raw, dict) and "build_config" in raw:
            raise ConvertError(f"{path}: an engine, not a checkpoint; convert takes a Hugging Face checkpoint")
        cfg = K3Config.from_dict(raw)
    except FileNotFoundError:
        raise ConvertError(f"{path}: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    except ConfigError as e:
        raise ConvertError(f"{path / 'config.json'}: {e}") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise ConvertError(f"{path / 'config.json'}: cannot read ({e.strerror})") from None
    tensors = _read_headers(path)
    try:
        flavour = detect_flavour(set(tensors), cfg)
        expected = checkpoint_tensors(cfg, flavour)
    except SchemaError as e:
        raise ConvertError(f"{path / 'config.json'}: {e}") from None
    _compare(path, tensors, expected, flavour)
    return Source(path, cfg, raw, flavour, tensors)


def _read_headers(path: Path) -> dict[str, TensorInfo]:
    index_file = path / INDEX
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except OSError as e:
            raise ConvertError(f"{index_file}: cannot read ({e.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ConvertError(f"{index_file}: corrupt index (expected JSON with a weight_map): {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            bad = weight_map if not isinstance(weight_map, dict) else next(
                f"{k}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str))
            raise ConvertError(f"{index_file}: corrupt index: weight_map must map tensor names to shard file names, "
                               f"got {bad!r:.200}")
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{path}: no *.safetensors files and no {INDEX}")
    # every shard the index names first: a tensor mapped to a missing file is that, not a stray in another shard
    for fname in files:
        if not (path / fname).is_file():
            if weight_map is None:
                raise ConvertError(f"{path / fname}: not a shard file (a directory, or a symlink to nothing)")
            name = next(k for k, v in weight_map.items() if v == fname)
            raise ConvertError(f"{index_file}: lists shard {fname} (for tensor {name}), which does not exist in "
                               f"{path}")
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        fpath = path / fname
        try:
            infos, _ = read_header(fpath)
        except SafetensorsError as e:
            raise ConvertError(str(e)) from None
        for full, info in infos.items():
            if weight_map is not None and weight_map.get(full) != fname:
                raise ConvertError(f"{fpath}: tensor {full}: unexpected tensor, not listed for this shard in {INDEX}")
            name = strip_prefix(full)
            if IGNORED.search(name):
                continue
            if name in tensors:
                raise ConvertError(f"{fpath}: tensor {full}: also stored in {tensors[name].path}")
            tensors[name] = info
    if weight_map is not None:
        seen = {i.name for i in tensors.values()}
        for full, fname in weight_map.items():
            if full not in seen and not IGNORED.search(strip_prefix(full)):
                raise ConvertError(f"{path / fname}: tensor {full}: listed in {INDEX} but missing from the shard")
    return tensors


def _compare(path: Path, tensors: dict[str, TensorInfo], expected: dict, flavour: str) -> None:
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        shape, dtype = expected[missing[0]]
        raise ConvertError(f"{path}: missing tensor {missing[0]}{more}: expected {dtype} {list(shape)} "
                           f"for this config ({flavour} naming)")
    for name, info in tensors.items():
        if name not in expected:
            raise ConvertError(f"{info.path}: tensor {info.name}: unexpected tensor for this config "
                               f"({flavour} naming)")
        shape, dtype = expected[name]
        if info.shape != shape:
            raise ConvertError(f"{info.path}: tensor {info.name}: wrong shape {list(info.shape)}, expected "
                               f"{list(shape)}")
        scale = name.endswith(".weight_scale")
        if not (dtype_matches(dtype, info.dtype) or (scale and info.dtype == E8M0)):
            want = "a float dtype (F32, BF16, F16)" if dtype == "float" else dtype
            want += f" or {E8M0} (the E8M0 bytes of MXFP4 block scales)" if scale else ""
            raise ConvertError(f"{info.path}: tensor {info.name}: wrong dtype {info.dtype}, expected {want}")


def output_config(src: Source, quantize: str | None) -> K3Config:
    """The converted checkpoint's config: the source's, with quantization as requested."""
    method = src.cfg.quantization.method if quantize is None else quantize
    try:
        return dataclasses.replace(src.cfg, quantization=QuantConfig(method))
    except ConfigError as e:
        raise ConvertError(f"--quantize {method}: {e}") from None


def check_mapping(mapping: Mapping, cfg: K3Config) -> None:
    try:
        mapping.validate(cfg)
    except MappingError as e:
        raise ConvertError(f"mapping {mapping.to_dict()} does not fit this model: {e}") from None


def plan_jobs(src: Source, cfg_out: K3Config) -> list[Job]:
    """One job per canonical output tensor (an expert quantized to MXFP4 yields packed + scale in one job)."""
    canon = checkpoint_tensors(cfg_out, "canonical")
    src_q, out_q = src.cfg.quantization.method, cfg_out.quantization.method
    jobs: list[Job] = []
    for name, info in src.tensors.items():
        cname = to_canonical_name(name, src.flavour)
        is_expert = ".experts." in cname
        if not is_expert or src_q == out_q:
            shape = canon[cname][0]
            # F8_E8M0 scales are the U8 ones' bytes: written as U8, the dtype build and the runtime take
            dtype = U8 if info.dtype == E8M0 else info.dtype
            jobs.append(Job("copy", (info,), (Output(cname, dtype, shape),)))
        elif out_q == "mxfp4":
            base = cname[: -len(".weight")]
            outs = tuple(Output(base + s, "U8", canon[base + s][0]) for s in (".weight_packed", ".weight_scale"))
            jobs.append(Job("quantize", (info,), outs))
        elif cname.endswith(".weight_packed"):
            base = cname[: -len(".weight_packed")]
            scale = src.tensors[name[: -len("_packed")] + "_scale"]
            jobs.append(Job("dequantize", (info, scale), (Output(base + ".weight", "BF16", canon[base + ".weight"][0]),)))
    produced = {o.name for j in jobs for o in j.outputs}
    assert produced == set(canon), sorted(produced ^ set(canon))[:5]
    return jobs
