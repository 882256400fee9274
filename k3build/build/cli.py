"""`k3build build` and `k3build inspect`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ..command import writing_command
from ..config import ConfigError
from ..convert import FORMAT as CONVERTED_FORMAT
from ..mapping import Mapping, MappingError
from ..output_dir import os_error_message
from .engine import ENGINE_FORMAT_VERSION, BuildError, build
from .options import DTYPES, EXPERT_BACKENDS, TARGETS, BuildOptions


def _recipe_build_options(recipe_path: str | None, converted: str) -> dict:
    """BuildOptions keywords from a recipe, after checking it describes this converted checkpoint."""
    if not recipe_path:
        return {}
    from ..recipe import load_recipe
    from .source import read_converted

    r = load_recipe(recipe_path)
    _, cfg, mapping = read_converted(Path(converted))
    if mapping != r.mapping:
        raise BuildError(f"{recipe_path}: [mapping] is {_mapping_str(r.mapping)} but {converted} was converted "
                         f"for {_mapping_str(mapping)}; convert with the recipe's mapping or pick its recipe")
    if r.model.preset is not None or r.model.checkpoint is not None:
        want = r.model_config()
        for field in ("num_hidden_layers", "hidden_size", "num_experts", "vocab_size"):
            if getattr(want, field) != getattr(cfg, field):
                raise BuildError(f"{recipe_path}: [model] has {field}={getattr(want, field)}, {converted} has "
                                 f"{getattr(cfg, field)}; its memory budget was planned for another model")
    return {k: v for k, v in r.build_options().items() if v is not None}


def _recipe_field(option: str) -> str:
    """Where a BuildOptions field lives in a recipe."""
    return "runtime.expert_backend" if option == "expert_backend" else f"build.{option}"


def _mapping_str(m: Mapping) -> str:
    return ", ".join(f"{k}={v}" for k, v in m.to_dict().items())


def _tactics(values: tuple[str, ...]) -> tuple[tuple[str, str], ...] | None:
    for v in values:
        if v.count("=") != 1 or not all(v.split("=")):
            raise click.BadParameter(f"expected OP=TACTIC (e.g. MoEExperts=triton), got {v!r}", param_hint="--tactic")
    return tuple(tuple(v.split("=")) for v in values) or None


def _os_error(e: OSError, converted: str, engine: str) -> str:
    """One line for an OSError met building: a file of the converted checkpoint that could not be read, or the
    engine that could not be written (no space left, a file size limit)."""
    name = e.filename and Path(os.fsdecode(e.filename)).resolve()
    if name and (name == Path(converted).resolve() or Path(converted).resolve() in name.parents):
        return f"{e.filename}: cannot read it ({e.strerror or e})"
    return os_error_message(Path(engine), "be written", e)


@click.command("build")
@click.argument("converted", type=click.Path(exists=True, file_okay=False))
@click.argument("engine", type=click.Path())
@click.option("--target", type=click.Choice(TARGETS), default=None, help="Device the engine runs on [cpu].")
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False), help="engines/X.toml: defaults for the options below.")
@click.option("--max-batch-size", type=int, default=None, help="Requests running at once [8].")
@click.option("--max-num-tokens", type=int, default=None, help="Tokens per step, prefill chunks included [2048].")
@click.option("--max-seq-len", type=int, default=None, help="Prompt + output tokens per request [4096].")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None, help="Activation/weight dtype [bf16].")
@click.option("--kv-dtype", type=click.Choice(list(DTYPES)), default=None, help="MLA latent cache dtype [bf16].")
@click.option("--state-dtype", type=click.Choice(["fp32", "bf16"]), default=None, help="KDA state storage [fp32].")
@click.option("--page-size", type=int, default=None, help="Tokens per MLA cache page [64].")
@click.option("--gpu-memory-gib", type=float, default=None, help="Per-rank memory budget the plan must fit.")
@click.option("--overhead-gib", type=float, default=None,
              help="Held back from the budget for communicators and allocator slack [1.0].")
@click.option("--expert-backend", type=click.Choice(list(EXPERT_BACKENDS)), default=None,
              help="Expert exchange the runtime starts with under attention-DP + EP [nccl].")
@click.option("--tactic", "tactics", multiple=True, metavar="OP=TACTIC", callback=lambda ctx, p, v: _tactics(v),
              help="Force a plugin tactic (repeatable), e.g. MoEExperts=triton_p; `k3build inspect` lists the ops.")
@click.option("--tune", is_flag=True, default=None,
              help="Measure tactic choices on this machine's GPU (FP8 prefill, taken where its drift is within the "
                   "parity bar).")
@click.option("--overwrite", is_flag=True, help="Replace an existing engine dir.")
@click.option("--progress/--no-progress", default=True,
              help="Show progress per rank (in a log: a line every 30 s).")
def build_cmd(converted, engine, recipe, overwrite, progress, **flags):
    """Build per-rank engines from a converted checkpoint."""
    with writing_command("build", engine, (BuildError, ConfigError, MappingError, ValueError, KeyError),
                         os_error=lambda e: _os_error(e, converted, engine)):
        from_recipe = _recipe_build_options(recipe, converted)
        given = {k: v for k, v in flags.items() if v is not None}
        for k in sorted(set(from_recipe) & set(given)):
            if from_recipe[k] != given[k]:  # the flag wins: say so, as the values differ
                click.echo(f"note: --{k.replace('_', '-')} {given[k]} overrides {recipe}'s {_recipe_field(k)} = "
                           f"{from_recipe[k]!r}", err=True)
        try:
            options = BuildOptions(**{**from_recipe, **given})
            out = build(converted, engine, options, overwrite=overwrite, progress=progress,
                        log=lambda m: click.echo(f"note: {m}", err=True))
        except (ValueError, BuildError) as e:
            # A bad value the user did not type comes from the recipe: say so, naming its field.
            named = [k for k in set(from_recipe) - set(given) if f"--{k.replace('_', '-')}" in str(e)]
            if named:
                section = "[runtime]" if named == ["expert_backend"] else "[build]"
                raise BuildError(f"{recipe} {section}: {e}") from None
            raise
    click.echo(f"engine written to {out}")


@click.command("inspect")
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the engine config as JSON.")
def inspect_cmd(engine, as_json):
    """Print an engine's plan, plugins and per-rank sizes."""
    path = Path(engine) / "config.json"
    if not path.exists():
        raise click.ClickException(f"{engine}: not an engine dir (no config.json); build one with `k3build build`")
    try:
        text = path.read_text()
    except OSError as e:  # a directory, no permission
        raise click.ClickException(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise click.ClickException(f"{path}: not a k3build engine config (not UTF-8 text: {e.reason} at byte "
                                   f"{e.start})") from None
    other = False  # an engine of another format version
    try:
        cfg = json.loads(text)
        if isinstance(cfg, dict) and cfg.get("format") == CONVERTED_FORMAT:
            raise click.ClickException(f"{engine}: a converted checkpoint, not an engine; build one from it with "
                                       f"`k3build build {engine} ENGINE_DIR`")
        if isinstance(cfg, dict) and "mapping" not in cfg and "model_type" in cfg:
            raise click.ClickException(f"{engine}: a Hugging Face checkpoint, not an engine; run `k3build convert` "
                                       "on it, then `k3build build` on the result")
        other = isinstance(cfg, dict) and cfg.get("version", ENGINE_FORMAT_VERSION) != ENGINE_FORMAT_VERSION
        if other:  # what follows may still read; the runtime will not load it
            click.echo(f"warning: {path}: engine format v{cfg['version']}, and this k3build reads and writes "
                       f"v{ENGINE_FORMAT_VERSION}: k3runtime refuses the engine; rebuild it with this k3build", err=True)
        lines, missing = _describe(Path(engine), cfg)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:  # ValueError: JSON, UTF-8
        why = f"format v{cfg['version']}, not v{ENGINE_FORMAT_VERSION}: " if other else ""
        raise click.ClickException(f"{path}: not a k3build engine config ({why}{type(e).__name__}: {e})") from None
    click.echo(json.dumps(cfg, indent=1) if as_json else "\n".join(lines))
    if missing:
        raise click.ClickException(f"{engine}: incomplete engine: {'; '.join(missing)}; build it again with "
                                   "`k3build build --overwrite`")


def _mib(n: int) -> str:
    if abs(n) < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) < 2**30 else f"{n / 2**30:.2f} GiB"


def _describe(engine: Path, cfg: dict) -> tuple[list[str], list[str]]:
    """The report's lines, and what is wrong with the rank files the config lists (missing, or not the size the
    build wrote)."""
    b, s, m = cfg["build_config"], cfg["stamp"], cfg["mapping"]
    out = [f"engine {engine}  (format v{cfg['version']}, k3build {s['k3build_version']}, target {s['target']}, "
           f"plugin ABI {s['plugin_abi']}, torch {s['torch']}, triton {s.get('triton') or '-'})",
           "mapping: " + ", ".join(f"{k}={v}" for k, v in m.items()),
           f"limits: max_batch_size={b['max_batch_size']} max_num_tokens={b['max_num_tokens']} "
           f"max_seq_len={b['max_seq_len']} page_size={b['page_size']}",
           f"dtypes: act={b['dtype']} kv={b['kv_dtype']} kda_state={b['state_dtype']}"]
    mp = cfg["memory_plan"]
    out.append(f"memory plan: {mp['num_pages']} pages of {mp['page_size']} tokens, {mp['num_slots']} KDA slots")
    budget = mp.get("budget")
    if budget:
        held = budget.get("memory_requests")  # engines built before it was planned lack it
        running = budget["max_concurrent_requests"]
        why = (f"max_batch_size {b['max_batch_size']} caps the KDA slots" if running == b["max_batch_size"] else
               "the KDA slots, given first, leave pages for no more of that length")  # as plan says it
        out.append(f"  budget {_mib(budget['gpu_memory_bytes'])} per rank: {running} requests of "
                   f"{budget['max_seq_len']} tokens run at once"
                   + (f" (memory holds {held}: {why})" if held is not None and held > running else ""))
        for r in budget["ranks"]:
            out.append(f"  rank{r['rank']}: weights {_mib(r['weight_bytes'])}, reserve {_mib(r['reserve_bytes'])}, "
                       f"free {_mib(r['free_bytes'])}: room for {r['kda_slots']} slots and {r['kv_pages']} pages")
    else:
        out.append("  (no --gpu-memory-gib budget: sized by the limits alone)")
    out.append("plugins:")
    for op, p in b["plugins"].items():
        out.append(f"  {op:<12} v{p['version']}  {p['tactic']}")
    out += [f"  note: {n}" for n in b.get("plugin_notes", [])]
    out.append("ranks:")
    missing = []
    for r, info in cfg["ranks"].items():
        graph, weights = engine / f"rank{r}" / "graph.onnx", engine / f"rank{r}" / "weights.safetensors"
        gsize = _mib(graph.stat().st_size) if graph.is_file() else "missing"
        wsize = _mib(info["weight_bytes"])
        if not weights.is_file():
            wsize = "missing"
        elif weights.stat().st_size != info["weight_bytes"]:
            wsize = f"{_mib(weights.stat().st_size)}, not the {_mib(info['weight_bytes'])} built"
            missing.append(f"rank{r}/weights.safetensors is {weights.stat().st_size} bytes, the build wrote "
                           f"{info['weight_bytes']}")
        missing += [f"rank{r}/{p.name} missing" for p in (graph, weights) if not p.is_file()]
        out.append(f"  rank{r}: pp={info['pp_rank']} tp={info['tp_rank']} layers {info['layers'][0]}..{info['layers'][1] - 1} "
                   f"experts {info['experts'][0]}..{info['experts'][1] - 1}  weights {wsize}  graph {gsize}")
    return out, missing
