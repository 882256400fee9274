"""Build recipes: one TOML file per deployment in engines/ (model, mapping, build limits, runtime backend).

    [model]    preset = "k3"            # or checkpoint = "path/to/ckpt" (relative to the recipe file)
    [mapping]  tp_size, pp_size, moe_tp_size, moe_ep_size, attention_dp
    [build]    target = "cpu" | "sm90" | "gfx942", max_batch_size, max_num_tokens, max_seq_len,
               dtype = "bf16" | "fp16" | "fp32", state_dtype = "fp32" | "bf16", kv_dtype = "bf16" | "fp16" | "fp32",
               page_size = 64, gpu_memory_gib, overhead_gib = 1.0   (`k3build build`'s options, checked as it does)
    [runtime]  expert_backend = "nccl" | "deepep" | "local"
    [plan]     expect_fits = true, why = "..."   # a recipe that documents a deployment that does not fit

Every mistake raises `RecipeError` naming the file and the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .build.options import EXPERT_BACKENDS, BuildOptions
from .config import PRESETS, ConfigError, K3Config, preset
from .mapping import Mapping, MappingError
from .memory import PAGE_SIZE, MemoryPlan, plan_memory


class RecipeError(ValueError):
    """A recipe file that cannot be read or holds a wrong value; the message names the file and field."""


@dataclass(frozen=True)
class ModelSpec:
    preset: str | None = None
    checkpoint: Path | None = None  # a checkpoint dir (or its config.json), resolved against the recipe's dir


@dataclass(frozen=True)
class BuildSpec:
    target: str
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    gpu_memory_gib: float  # device memory per rank as torch reports it (k3build.memory's convention)
    dtype: str = "bf16"
    state_dtype: str = "fp32"
    kv_dtype: str = "bf16"
    page_size: int = PAGE_SIZE
    overhead_gib: float = 1.0


@dataclass(frozen=True)
class RuntimeSpec:
    expert_backend: str = "nccl"


@dataclass(frozen=True)
class Recipe:
    path: Path
    name: str  # the file stem
    description: str
    model: ModelSpec
    mapping: Mapping
    build: BuildSpec
    runtime: RuntimeSpec
    expect_fits: bool = True
    why: str = ""

    def model_config(self) -> K3Config:
        if self.model.preset is not None:
            return preset(self.model.preset)
        ckpt = self.model.checkpoint
        assert ckpt is not None
        try:
            return K3Config.from_file(ckpt / "config.json" if ckpt.is_dir() else ckpt)
        except ConfigError as e:
            raise RecipeError(f"{self.path}: model.checkpoint: {e}") from None

    def build_options(self) -> dict[str, Any]:
        """Keyword arguments for `k3build.build.options.BuildOptions`."""
        return {**_build_options(self.build), "expert_backend": self.runtime.expert_backend}

    def plan(self, cfg: K3Config | None = None) -> MemoryPlan:
        """The memory plan for this recipe (what `k3build plan --recipe` prints)."""
        return plan_memory(cfg or self.model_config(), self.mapping, max_seq_len=self.build.max_seq_len,
                           **BuildOptions(**_build_options(self.build)).plan_limits())


_SECTIONS = {"description", "model", "mapping", "build", "runtime", "plan"}
_MAPPING = {"tp_size": int, "pp_size": int, "moe_tp_size": int, "moe_ep_size": int, "attention_dp": bool}
_BUILD = {"target": str, "max_batch_size": int, "max_num_tokens": int, "max_seq_len": int, "gpu_memory_gib": float,
          "dtype": str, "state_dtype": str, "kv_dtype": str, "page_size": int, "overhead_gib": float}
_BUILD_REQUIRED = ("target", "max_batch_size", "max_num_tokens", "max_seq_len", "gpu_memory_gib")


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate one recipe file. Raises RecipeError("<file>: <section>.<field>: ...")."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: not valid TOML ({e})") from None
    try:
        return _parse(path, raw)
    except (RecipeError, MappingError, ConfigError) as e:
        raise RecipeError(f"{path}: {e}") from None


def load_recipes(folder: str | Path) -> list[Recipe]:
    return [load_recipe(p) for p in sorted(Path(folder).glob("*.toml"))]


def _parse(path: Path, raw: dict[str, Any]) -> Recipe:
    unknown = sorted(set(raw) - _SECTIONS)
    if unknown:
        raise RecipeError(f"{unknown[0]}: unknown section (expected {', '.join(sorted(_SECTIONS))})")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise RecipeError("description: expected a string")
    model = _model(path, _section(raw, "model", required=True))
    m = _typed(_section(raw, "mapping"), "mapping", _MAPPING)
    mapping = Mapping(**m)
    b = _typed(_section(raw, "build", required=True), "build", _BUILD)
    for k in _BUILD_REQUIRED:
        if k not in b:
            raise RecipeError(f"build.{k}: required field missing")
    build = BuildSpec(**b)
    rt = _typed(_section(raw, "runtime"), "runtime", {"expert_backend": str})
    runtime = RuntimeSpec(**rt)
    _check_runtime(runtime, mapping, build)
    _check_build(build)
    p = _typed(_section(raw, "plan"), "plan", {"expect_fits": bool, "why": str})
    if p.get("expect_fits") is False and not p.get("why"):
        raise RecipeError("plan.why: a recipe with expect_fits = false must say why it does not fit")
    if model.preset is not None:
        mapping.validate(preset(model.preset))
    return Recipe(path=path, name=path.stem, description=description, model=model, mapping=mapping, build=build,
                  runtime=runtime, expect_fits=p.get("expect_fits", True), why=p.get("why", ""))


def _section(raw: dict, name: str, required: bool = False) -> dict:
    if name not in raw:
        if required:
            raise RecipeError(f"[{name}]: required section missing")
        return {}
    if not isinstance(raw[name], dict):
        raise RecipeError(f"{name}: expected a [{name}] table")
    return raw[name]


def _typed(d: dict, section: str, fields: dict[str, type]) -> dict:
    out = {}
    for k, v in d.items():
        if k not in fields:
            raise RecipeError(f"{section}.{k}: unknown field (expected one of {', '.join(fields)})")
        want = fields[k]
        ok = isinstance(v, want) and (want is bool or not isinstance(v, bool))
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v, ok = float(v), True
        if not ok:
            raise RecipeError(f"{section}.{k}: expected {want.__name__}, got {type(v).__name__} {v!r}")
        out[k] = v
    return out


def _model(path: Path, d: dict) -> ModelSpec:
    m = _typed(d, "model", {"preset": str, "checkpoint": str})
    if ("preset" in m) == ("checkpoint" in m):
        raise RecipeError("model: give exactly one of preset or checkpoint")
    if "preset" in m:
        if m["preset"] not in PRESETS:
            raise RecipeError(f"model.preset: unknown {m['preset']!r}; known: {', '.join(PRESETS)}")
        return ModelSpec(preset=m["preset"])
    ckpt = Path(m["checkpoint"])
    return ModelSpec(checkpoint=ckpt if ckpt.is_absolute() else path.parent / ckpt)


def _build_options(b: BuildSpec) -> dict[str, Any]:
    return {k: getattr(b, k) for k in ("target", "max_batch_size", "max_num_tokens", "max_seq_len", "page_size",
                                       "dtype", "kv_dtype", "state_dtype", "gpu_memory_gib", "overhead_gib")}


def _check_build(b: BuildSpec) -> None:
    """The checks `k3build build` makes of the same values, so a recipe `plan` passes is one `build` takes;
    its messages name the command-line flag, renamed here to the recipe's field."""
    try:
        BuildOptions(**_build_options(b))
    except ValueError as e:
        raise RecipeError(re.sub(r"--([a-z-]+)", lambda m: "build." + m.group(1).replace("-", "_"), str(e))) from None


def _check_runtime(r: RuntimeSpec, mapping: Mapping, b: BuildSpec) -> None:
    if r.expert_backend not in EXPERT_BACKENDS:
        raise RecipeError(f"runtime.expert_backend: expected one of {', '.join(EXPERT_BACKENDS)}, "
                          f"got {r.expert_backend!r}")
    if r.expert_backend == "local" and mapping.moe_ep_size != 1:
        raise RecipeError(f"runtime.expert_backend: 'local' keeps every expert on its rank, but "
                          f"moe_ep_size={mapping.moe_ep_size}; use 'nccl'")
    if r.expert_backend == "deepep" and b.target == "cpu":
        raise RecipeError("runtime.expert_backend: 'deepep' needs a GPU target, got build.target = 'cpu'")
    if r.expert_backend == "deepep" and not (mapping.attention_dp and mapping.moe_ep_size > 1):
        raise RecipeError(f"runtime.expert_backend: 'deepep' serves attention-DP + EP only, but the mapping has "
                          f"attention_dp={str(mapping.attention_dp).lower()}, moe_ep_size={mapping.moe_ep_size}; "
                          "use 'nccl'")
    if r.expert_backend == "deepep" and b.dtype != "bf16":
        raise RecipeError(f"runtime.expert_backend: 'deepep' carries bf16 tokens, but build.dtype = {b.dtype!r}")
