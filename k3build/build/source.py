"""Read and check a converted checkpoint before anything is built from it.

Every rank file's header is checked against the checkpoint's mapping (its `k3_rank`/`k3_world_size` and the
`k3_slices` the converter recorded must be what `Mapping.shard` says) and against config.json's conversion id,
so a renamed, stale (another run's) or truncated file is refused before the first byte of an engine is written.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError, K3Config
from ..mapping import Mapping, MappingError
from ..safetensors_io import SafetensorsError, read_header
from ..schema import FLOAT, FLOAT_DTYPES, SchemaError, Spec, checkpoint_tensors, dtype_matches


class BuildError(RuntimeError):
    """The build cannot proceed; the message says why and what to change."""


def read_converted(converted_dir: Path) -> tuple[dict, K3Config, Mapping]:
    """Returns (raw config.json, model config, mapping) after checking every rank file's header."""
    path = converted_dir / "config.json"
    if not converted_dir.is_dir():
        raise BuildError(f"{converted_dir}: no such directory (expected the output of `k3build convert`)")
    if not path.exists():
        raise BuildError(f"{converted_dir}: not a converted checkpoint (no config.json); run `k3build convert` first")
    try:
        raw = json.loads(path.read_text())
    except UnicodeDecodeError as e:
        raise BuildError(f"{path}: not valid JSON (not UTF-8 text: {e})") from None
    except json.JSONDecodeError as e:
        raise BuildError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or "mapping" not in raw:
        raise BuildError(f"{path}: no 'mapping' field; this looks like an HF checkpoint — run `k3build convert` "
                         "on it first")
    try:
        cfg = K3Config.from_dict({k: v for k, v in raw.items()
                                  if k not in ("mapping", "source", "format", "conversion_id")})
        mapping = Mapping.from_dict(raw["mapping"])
        mapping.validate(cfg)
    except (ConfigError, MappingError, TypeError) as e:
        raise BuildError(f"{path}: {e}") from None
    try:
        canon = checkpoint_tensors(cfg, "canonical")
    except SchemaError as e:
        raise BuildError(f"{path}: {e}") from None
    for rank in range(mapping.world_size):
        check_rank_file(converted_dir / f"rank{rank}.safetensors", cfg, mapping, rank, canon,
                        raw.get("conversion_id"), exact_dtypes=(raw.get("source") or {}).get("flavour") == "k3")
    extra = sorted(p.name for p in converted_dir.glob("rank*.safetensors")
                   if p.stem[4:].isdigit() and int(p.stem[4:]) >= mapping.world_size)
    if extra:
        raise BuildError(f"{converted_dir}: {', '.join(extra)} beyond the mapping's world_size {mapping.world_size} "
                         f"({path} and the rank files disagree; convert again)")
    return raw, cfg, mapping


def check_rank_file(path: Path, cfg: K3Config, mapping: Mapping, rank: int, canon: dict[str, Spec],
                    conversion_id: str | None = None, *, exact_dtypes: bool = False) -> None:
    """Refuse a rank file that is missing, corrupt, sliced for another rank or mapping, written by another run of
    convert than config.json's `conversion_id` (None: a conversion from before the id), or whose tensors are not
    the model's that config.json describes (canon: checkpoint_tensors(cfg, "canonical")): a name, a whole shape,
    a dtype (exact_dtypes: the canonical one, as convert writes from a K3 checkpoint; else its kind, float or
    packed bytes) or a tensor of the rank's missing."""
    if not path.exists():
        raise BuildError(f"{path}: missing (the mapping has world_size {mapping.world_size}); convert again")
    try:
        tensors, meta = read_header(path)
    except SafetensorsError as e:
        raise BuildError(f"{e}; convert again") from None
    again = f"it was converted for another rank or mapping than {path.parent}/config.json says; convert again"
    if meta.get("k3_rank") != str(rank) or meta.get("k3_world_size") != str(mapping.world_size):
        raise BuildError(f"{path}: holds rank {meta.get('k3_rank')} of world size {meta.get('k3_world_size')}, "
                         f"expected rank {rank} of {mapping.world_size}; {again}")
    if conversion_id is not None and meta.get("k3_conversion_id") != conversion_id:
        raise BuildError(f"{path}: written by another run of convert (conversion id "
                         f"{meta.get('k3_conversion_id')}) than {path.parent}/config.json ({conversion_id}): files "
                         "of two conversions mixed; convert again")
    try:
        slices = json.loads(meta.get("k3_slices", "{}"))
    except json.JSONDecodeError:
        raise BuildError(f"{path}: corrupt k3_slices metadata; convert again") from None
    for name, s in slices.items():
        try:
            shard = mapping.shard(name, rank, cfg)
        except ConfigError as e:
            raise BuildError(f"{path}: {e}") from None
        if shard is None:
            raise BuildError(f"{path}: tensor {name!r} does not belong on rank {rank}; {again}")
        dim = shard.dim if shard.parts > 1 else None
        want = _norm(dim, *shard.bounds(s["shape"][dim]), s["shape"]) if dim is not None else (None,)
        have = _norm(s["dim"], s["start"], s["stop"], s["shape"])
        if want != have:
            raise BuildError(f"{path}: tensor {name!r} holds slice {have} of {s['shape']}, the mapping gives rank "
                             f"{rank} {want}; {again}")
    model = f"the model {path.parent}/config.json describes"
    for name, info in tensors.items():
        if name not in canon:
            raise BuildError(f"{path}: tensor {name!r} is not one of {model}; convert again")
        shape, dtype = canon[name]
        local = list(shape)
        if name in slices:
            s = slices[name]
            if tuple(s["shape"]) != shape:
                raise BuildError(f"{path}: tensor {name!r} is a slice of {s['shape']}, {model} has {list(shape)}; "
                                 "convert again")
            if s["dim"] is not None:
                local[s["dim"]] = s["stop"] - s["start"]
        if list(info.shape) != local:
            raise BuildError(f"{path}: tensor {name!r} is {list(info.shape)}, expected {local} ({model}, this "
                             "rank's slice); convert again")
        # a Kimi-Linear checkpoint's floats keep their dtype
        kind = FLOAT if dtype in FLOAT_DTYPES and not exact_dtypes else dtype
        if not dtype_matches(kind, info.dtype):
            raise BuildError(f"{path}: tensor {name!r} is {info.dtype}, {model} has {dtype}; convert again")
    missing = [n for n in slices if n not in tensors]  # the converter records a slice for each tensor it wrote
    if missing:
        raise BuildError(f"{path}: {len(missing)} tensors of rank {rank} missing, the first {missing[0]!r}; "
                         "convert again")
    # last: a config edited where it changes a shape is named by the checks above, by tensor
    if "k3_config" in meta:  # conversions before it lack it
        try:
            was = json.loads(meta["k3_config"])
        except json.JSONDecodeError:
            raise BuildError(f"{path}: corrupt k3_config metadata; convert again") from None
        now = json.loads(json.dumps(cfg.to_dict()))
        # fields both know: one that k3build added (or dropped) since the convert is no edit of config.json
        changed = _changed_fields(was, now)
        if changed:
            k, old_value, new_value = changed[0]
            raise BuildError(f"{path.parent}/config.json: {k} is {new_value!r}, but {path.name} was converted with "
                             f"{old_value!r} ({len(changed)} field(s) changed after convert); restore config.json "
                             "or convert again")


def _changed_fields(was: dict, now: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted name, value at convert, value now) of the fields, nested ones included, that both configs hold and
    that differ."""
    out = []
    for k in sorted(set(was) & set(now)):
        a, b = was[k], now[k]
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_fields(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append((f"{prefix}{k}", a, b))
    return out


def _norm(dim: int | None, start: int, stop: int, shape: list[int]) -> tuple:
    # (dim, start, stop) of a slice; a slice covering the whole tensor is just (None,)
    if dim is None or (start, stop) == (0, shape[dim]):
        return (None,)
    return (dim, start, stop)
