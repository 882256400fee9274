"""`k3build plan`: per-rank memory budget of a mapping, and how many requests fit, or why nothing does.

Precedence of every setting: command-line option > recipe (`--recipe engines/X.toml`) > the checkpoint's own
`mapping` (a converted checkpoint) > default. Exit code 1 with the reason when a rank cannot hold one request.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .build.options import DTYPES, BuildOptions
from .config import ConfigError, K3Config, preset, read_json
from .mapping import Mapping, MappingError, moe_tp_from_flags
from .memory import CATEGORIES, GiB, MiB, DEFAULT_OVERHEAD_BYTES, MemoryPlan, plan_memory
from .recipe import RecipeError, load_recipe

STANDARD_LENGTHS = (8192, 32768, 131072)
_SHORT = {"embedding": "embed", "lm_head": "lm_head", "attention_kda": "KDA", "attention_mla": "MLA",
          "dense_mlp": "dense", "shared_experts": "shared", "router_latent_norms": "router+latent+norms",
          "routed_experts": "experts"}


def plans_by_length(cfg: K3Config, mapping: Mapping, plan: MemoryPlan, **limits) -> dict[int, MemoryPlan]:
    """The plans of engines built for each standard length below max_seq_len, and for max_seq_len (`plan`)."""
    lengths = sorted({n for n in STANDARD_LENGTHS if n < plan.max_seq_len} | {plan.max_seq_len})
    return {n: plan if n == plan.max_seq_len else plan_memory(cfg, mapping, max_seq_len=n, **limits) for n in lengths}


@click.command("plan")
@click.argument("ckpt", required=False, type=click.Path(exists=True, path_type=Path))
@click.option("--preset", "preset_name", help="a named config instead of a checkpoint (k3, tiny, small)")
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="engines/X.toml: model, mapping and limits; options given here override it")
@click.option("--tp-size", type=click.IntRange(min=1), help="ranks per PP stage (attention TP unless --attention-dp)")
@click.option("--ep-size", type=click.IntRange(min=1),
              help="routed-expert parallelism (moe_ep_size); default tp / moe-tp")
@click.option("--pp-size", type=click.IntRange(min=1), help="pipeline stages [default: 1]")
@click.option("--moe-tp-size", type=click.IntRange(min=1), help="split each expert's intermediate dim; default tp / ep")
@click.option("--attention-dp/--no-attention-dp", default=None, help="replicate attention, each rank its requests")
@click.option("--gpu-memory-gib", type=click.FloatRange(min=0, min_open=True),
              help="device memory per rank as torch reports it (H200: 139.8); required without --recipe")
@click.option("--max-seq-len", type=click.IntRange(min=1),
              help="longest sequence a request may reach; required without --recipe")
@click.option("--max-batch-size", type=click.IntRange(min=1), help="[default: 64; `build` defaults to 8]")
@click.option("--max-num-tokens", type=click.IntRange(min=1),
              help="tokens per forward step per rank [default: 8192; `build` defaults to 2048]")
@click.option("--dtype", type=click.Choice(list(DTYPES)),
              help="activations, 16-bit weights and KDA conv state, as `build --dtype` [default: bf16]")
@click.option("--state-dtype", type=click.Choice(["fp32", "bf16"]), help="KDA recurrent state [default: fp32]")
@click.option("--kv-dtype", type=click.Choice(list(DTYPES)), help="MLA cache, as `build --kv-dtype` [default: bf16]")
@click.option("--page-size", type=click.IntRange(min=1), help="[default: 64]")
@click.option("--overhead-gib", type=float, help="fixed reserve per rank [default: 1.0]")
@click.option("--expert-format", type=click.Choice(["mxfp4", "bf16"]),
              help="routed experts as converted (convert --quantize mxfp4 of a bf16 checkpoint) [default: as stored]")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
def plan_cmd(ckpt, preset_name, recipe, tp_size, ep_size, pp_size, moe_tp_size, attention_dp, gpu_memory_gib,
             max_seq_len, max_batch_size, max_num_tokens, dtype, state_dtype, kv_dtype, page_size, overhead_gib,
             expert_format, as_json):
    """Memory plan for CKPT (a checkpoint dir or config.json) or --preset under a parallel mapping."""
    try:
        rec = load_recipe(recipe) if recipe else None
        cfg, ckpt_mapping = _model(ckpt, preset_name, rec)
        base = rec.mapping if rec else ckpt_mapping or Mapping()
        mapping = _mapping(base, tp_size, ep_size, pp_size, moe_tp_size, attention_dp)
        b = rec.build if rec else None

        def pick(cli, field, default=None):
            return cli if cli is not None else getattr(b, field, default)

        gpu, seq = pick(gpu_memory_gib, "gpu_memory_gib"), pick(max_seq_len, "max_seq_len")
        if gpu is None or seq is None:
            raise click.UsageError("--gpu-memory-gib and --max-seq-len are required (or give --recipe)")
        # checked as `build` checks them (the recipe's target, else cpu's rules), so what plan passes build takes
        options = BuildOptions(
            target=getattr(b, "target", "cpu"), max_seq_len=seq, gpu_memory_gib=gpu,
            max_batch_size=pick(max_batch_size, "max_batch_size", 64),
            max_num_tokens=pick(max_num_tokens, "max_num_tokens", 8192), page_size=pick(page_size, "page_size", 64),
            dtype=pick(dtype, "dtype", "bf16"), kv_dtype=pick(kv_dtype, "kv_dtype", "bf16"),
            state_dtype=pick(state_dtype, "state_dtype", "fp32"),
            overhead_gib=pick(overhead_gib, "overhead_gib", DEFAULT_OVERHEAD_BYTES / GiB))
        limits = {**options.plan_limits(), "expert_format": expert_format}
        plan = plan_memory(cfg, mapping, max_seq_len=seq, **limits)
        by_len = plans_by_length(cfg, mapping, plan, **limits)
    except (RecipeError, ConfigError, MappingError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"model": _model_summary(cfg), **plan.to_dict(),
                               "concurrency_by_length": {str(k): p.max_concurrent_requests for k, p in by_len.items()},
                               "memory_requests_by_length": {str(k): p.memory_requests for k, p in by_len.items()}},
                              indent=1))
        if not plan.fits:
            raise click.ClickException(f"does not fit: {plan.reason}")
    else:
        click.echo(render(cfg, plan, by_len))  # its last line says why it does not fit: exit 1 without repeating it
        if not plan.fits:
            raise SystemExit(1)


def _model(ckpt: Path | None, preset_name: str | None, rec) -> tuple[K3Config, Mapping | None]:
    if ckpt is not None and preset_name:
        raise click.UsageError("give CKPT or --preset, not both")
    if ckpt is None and not preset_name:
        if rec is None:
            raise click.UsageError("give CKPT, --preset or --recipe")
        return rec.model_config(), None
    if preset_name:
        return preset(preset_name), None
    path = ckpt / "config.json" if ckpt.is_dir() else ckpt
    raw = read_json(path)
    if isinstance(raw, dict) and "build_config" in raw:
        raise ConfigError(f"{path}: an engine's config, not a checkpoint's; plan takes a checkpoint (converted or "
                          "not), --preset or --recipe (`k3build inspect ENGINE` shows an engine's memory plan)")
    cfg = K3Config.from_json(path, raw)
    m = raw.get("mapping") if isinstance(raw, dict) else None
    try:
        return cfg, Mapping.from_dict(m) if isinstance(m, dict) else None
    except MappingError as e:
        raise ConfigError(f"{path}: {e}") from None


def _mapping(base: Mapping, tp, ep, pp, moe_tp, attention_dp) -> Mapping:
    tp = tp if tp is not None else base.tp_size
    if ep is None and moe_tp is None and tp == base.tp_size:
        ep, moe_tp = base.moe_ep_size, base.moe_tp_size
    if moe_tp is None:
        moe_tp = moe_tp_from_flags(tp, ep)
    return Mapping(tp_size=tp, pp_size=pp if pp is not None else base.pp_size, moe_tp_size=moe_tp,
                   moe_ep_size=ep, attention_dp=base.attention_dp if attention_dp is None else attention_dp)


def _model_summary(cfg: K3Config) -> dict:
    return {"num_hidden_layers": cfg.num_hidden_layers, "kda_layers": len(cfg.kda_layers),
            "mla_layers": len(cfg.mla_layers), "num_experts": cfg.num_experts, "hidden_size": cfg.hidden_size,
            "quantization": cfg.quantization.method}


def render(cfg: K3Config, plan: MemoryPlan, by_len: dict[int, MemoryPlan]) -> str:
    """The plain-text report: model facts, a weights table and a budget table (identical ranks grouped)."""
    m = plan.mapping
    kda, mla = len(cfg.kda_layers), len(cfg.mla_layers)
    state = plan.kda_state_bytes_per_request_model
    lines = [
        f"model: {cfg.num_hidden_layers} layers ({kda} KDA + {mla} MLA), {cfg.num_experts} experts "
        f"({plan.expert_format}), hidden {cfg.hidden_size}",
        f"mapping: tp {m['tp_size']} x pp {m['pp_size']} = {m['world_size']} ranks, experts ep {m['moe_ep_size']} x "
        f"moe_tp {m['moe_tp_size']}, attention-DP {'on' if m['attention_dp'] else 'off'}",
        f"limits: device {plan.gpu_memory_bytes / GiB:.2f} GiB/rank, max_seq_len {plan.max_seq_len}, "
        f"max_batch_size {plan.max_batch_size}, max_num_tokens {plan.max_num_tokens}, page {plan.page_size}",
        f"MLA KV: {plan.kv_bytes_per_token_model:,} B/token ({mla} layers x {cfg.mla_cache_width} x "
        f"{plan.kv_dtype_bytes} B), not split by attention TP",
        f"KDA state: {state:,} B = {state / MiB:.1f} MiB/request ({plan.state_dtype} recurrent + {plan.dtype} conv, "
        f"{kda} layers), " + ("whole on the rank serving it (attention-DP)" if m["attention_dp"]
                              else "split by attention TP"),
        "",
    ]
    groups = _group(plan)
    # Tiny models read better in MiB.
    unit, scale = ("GiB", GiB) if max(r.weight_bytes for r in plan.ranks) >= GiB else ("MiB", MiB)
    head = ["ranks", "layers"] + [_SHORT[c] for c in CATEGORIES] + ["total"]
    rows = [[g, f"{r.layers[0]}-{r.layers[1] - 1}"] + [f"{r.weights[c] / scale:.2f}" for c in CATEGORIES]
            + [f"{r.weight_bytes / scale:.2f}"] for g, r in groups]
    lines += [f"weights per rank ({unit})"] + _table(head, rows) + [""]
    head = ["ranks", f"weights {unit}", f"reserve {unit}", f"free {unit}", "KV B/token", "KDA MiB/req",
            f"req@{_tokens(plan.max_seq_len)}", "KDA slots", "KV pages", "fits"]
    rows = [[g, f"{r.weight_bytes / scale:.2f}", f"{r.reserve_bytes / scale:.2f}", f"{r.free_bytes / scale:.2f}",
             f"{r.kv_bytes_per_token:,}", f"{r.kda_state_bytes_per_request / MiB:.2f}",
             str(r.memory_requests), str(r.kda_slots), f"{r.kv_pages:,}", "yes" if r.fits else "NO"]
            for g, r in groups]
    lines += ["budget per rank"] + _table(head, rows)
    w = plan.worst_rank
    peak = max((k for k in w.reserve if k.startswith("peak_")), key=w.reserve.get)
    lines += [f"reserve of rank {w.rank}: " + ", ".join(f"{k} {w.reserve[k] / scale:.2f}" for k in
                                                       ("overhead", "spare", "residual", "exchange",
                                                        "penalty_counts", peak))
              + f" {unit}", ""]
    lines.append("max concurrent requests (all ranks): "
                 + ", ".join(f"{p.max_concurrent_requests} at {_tokens(L)}" for L, p in by_len.items()))
    held = [f"{p.memory_requests} at {_tokens(L)} ({_why_fewer(p)})" for L, p in by_len.items()
            if p.memory_requests != p.max_concurrent_requests]
    if held:
        lines.append("memory holds more: " + ", ".join(held))
    lines += [f"note: {n}" for n in plan.notes]
    lines.append("FITS" if plan.fits else f"DOES NOT FIT: {plan.reason}")
    return "\n".join(lines)


def _why_fewer(plan: MemoryPlan) -> str:
    """Why fewer requests of max_seq_len run than the memory holds: the KDA slots, at most max_batch_size, are all
    taken; or the slots, given first, leave pages for fewer full-length requests (the rest serve shorter ones)."""
    w = plan.worst_rank
    if w.max_concurrent_requests == w.kda_slots:
        return f"max_batch_size {plan.max_batch_size} caps the KDA slots"
    return f"its {w.kda_slots} KDA slots leave pages for {w.max_concurrent_requests} of that length"


def _group(plan: MemoryPlan):
    """Ranks whose numbers are all equal share a row, named like '0-7' or '0,2'."""
    seen: dict = {}
    for r in plan.ranks:
        d = r.to_dict()
        key = json.dumps({k: v for k, v in d.items() if k not in ("rank", "tp_rank", "reason")}, sort_keys=True)
        seen.setdefault(key, []).append(r)
    return [(_ranges([r.rank for r in rs]), rs[0]) for rs in seen.values()]


def _ranges(ids: list[int]) -> str:
    parts, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    def fmt(cells):
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [fmt(head)] + [fmt(r) for r in rows]


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)
