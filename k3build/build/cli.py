"""`k3build build` and `k3build inspect`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..config import ConfigError
from ..mapping import MappingError
from .engine import BuildError, build
from .options import DTYPES, TARGETS, BuildOptions


def _recipe_build_options(recipe_path: str | None) -> dict:
    if not recipe_path:
        return {}
    from ..recipe import load_recipe

    r = load_recipe(recipe_path)
    return {k: v for k, v in r.build_options().items() if v is not None}


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
@click.option("--overwrite", is_flag=True, help="Replace an existing engine dir.")
def build_cmd(converted, engine, recipe, overwrite, **flags):
    """Build per-rank engines from a converted checkpoint."""
    try:
        opts = {**_recipe_build_options(recipe), **{k: v for k, v in flags.items() if v is not None}}
        options = BuildOptions(**opts)
        out = build(converted, engine, options, overwrite=overwrite)
    except (BuildError, ConfigError, MappingError, ValueError, KeyError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"engine written to {out}")


@click.command("inspect")
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the engine config as JSON.")
def inspect_cmd(engine, as_json):
    """Print an engine's plan, plugins and per-rank sizes."""
    path = Path(engine) / "config.json"
    if not path.exists():
        raise click.ClickException(f"{engine}: not an engine dir (no config.json)")
    cfg = json.loads(path.read_text())
    if as_json:
        click.echo(json.dumps(cfg, indent=1))
        return
    b, s, m = cfg["build_config"], cfg["stamp"], cfg["mapping"]
    click.echo(f"engine {engine}  (format v{cfg['version']}, k3build {s['k3build_version']}, target {s['target']}, "
               f"plugin ABI {s['plugin_abi']}, torch {s['torch']})")
    click.echo("mapping: " + ", ".join(f"{k}={v}" for k, v in m.items()))
    click.echo(f"limits: max_batch_size={b['max_batch_size']} max_num_tokens={b['max_num_tokens']} "
               f"max_seq_len={b['max_seq_len']} page_size={b['page_size']}")
    click.echo(f"dtypes: act={b['dtype']} kv={b['kv_dtype']} kda_state={b['state_dtype']}")
    mp = cfg["memory_plan"]
    click.echo(f"memory plan: {mp['num_pages']} pages of {mp['page_size']} tokens, {mp['num_slots']} KDA slots")
    click.echo("plugins:")
    for op, p in b["plugins"].items():
        click.echo(f"  {op:<12} v{p['version']}  {p['tactic']}")
    click.echo("ranks:")
    for r, info in cfg["ranks"].items():
        click.echo(f"  rank{r}: pp={info['pp_rank']} tp={info['tp_rank']} layers {info['layers'][0]}..{info['layers'][1] - 1} "
                   f"experts {info['experts'][0]}..{info['experts'][1] - 1}  weights {info['weight_bytes'] / 2**20:.1f} MiB")
