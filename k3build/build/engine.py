"""`build`: converted checkpoint -> engine dir (DESIGN.md "Engine dir").

ENGINE/config.json  {version, pretrained_config, mapping, build_config, stamp, ranks, memory_plan,
                    generation_config (EOS ids and sampling defaults of generation_config.json, see
                    k3build/generation_config.py; {} without one)}
ENGINE/rank{N}/graph.onnx, ENGINE/rank{N}/weights.safetensors, tokenizer files.
Written into a hidden sibling directory and renamed into place, so an interrupted build leaves no ENGINE dir
(output_dir.py: a SIGKILLed build's staging dir is removed by the next build).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import onnx
import torch
from k3plugins.progress import progress_bar
from safetensors import safe_open

from ..config import K3Config
from ..mapping import Mapping
from ..finite import first_nonfinite
from ..generation_config import read_generation_config
from ..memory import MAX_GIB, GiB, kda_state_bytes, kv_bytes_per_token, plan_memory, size_text
from ..mxfp4 import MXFP4Error, check_scale
from ..output_dir import check_output_dir, staged_output
from ..tokenizer import TOKENIZER_FILES, tokenizer_note
from . import graph as graph_mod
from .layout import engine_tensors
from .options import DTYPES, BuildOptions
from .source import BuildError, read_converted
from .st_writer import SafetensorsWriter
from .tactics import (PLUGIN_OPS, W4_TACTICS, expert_layout, fit_mla_tactic, fit_moe_tactic, record_tactic,
                      resolve_plugins, stamp_for)

# W4A16 MoE tactics that --tune may replace with triton_f8 -> their prefill kernel tactic
RELAID_W4 = {"triton_l": "prefill_l", "triton_p": "prefill_p", "triton_s": "prefill_s"}

ENGINE_FORMAT_VERSION = 1


def build(converted_dir: str | os.PathLike, engine_dir: str | os.PathLike, options: BuildOptions, *,
          overwrite: bool = False, progress: bool = True, log: Callable[[str], None] | None = None) -> Path:
    """Build the engine dir `engine_dir` from the converted checkpoint `converted_dir`.

    Args:
        log: receives notes the user should see (a preferred plugin tactic that is not available here).
    Raises:
        BuildError naming the file/option at fault; ENGINE is then left as it was.
    """
    converted_dir, engine_dir = Path(converted_dir), Path(engine_dir)
    check_output_dir(engine_dir, converted_dir, overwrite=overwrite,
                     ours=lambda cfg: "version" in cfg and "build_config" in cfg, what="an engine", error=BuildError)
    _, cfg, mapping = read_converted(converted_dir)
    generation = read_generation_config(converted_dir, cfg.vocab_size, BuildError)
    if options.max_seq_len > cfg.max_position_embeddings:
        raise BuildError(f"--max-seq-len: {options.max_seq_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}, {converted_dir}/config.json)")
    if options.expert_backend == "local" and mapping.moe_ep_size > 1:
        raise BuildError(f"--expert-backend local: {converted_dir} is split over moe_ep_size={mapping.moe_ep_size} "
                         "ranks, whose experts must be exchanged; use nccl or deepep")
    if options.expert_backend == "deepep" and not (mapping.attention_dp and mapping.moe_ep_size > 1):
        # no EPGather/EPScatter in the graph, yet k3runtime would require deep_ep at every start of this engine
        raise BuildError(f"--expert-backend deepep: {converted_dir} has no expert exchange to run it (attention_dp="
                         f"{mapping.attention_dp}, moe_ep_size={mapping.moe_ep_size}; DeepEP serves attention-DP + "
                         "EP only); use nccl")
    if options.tune and not torch.cuda.is_available():
        raise BuildError("--tune: measures tactics on this machine's GPU, and torch sees none; build without --tune "
                         "or on a machine with the target GPU")
    log = log or (lambda m: None)
    if note := tokenizer_note(converted_dir):  # said before the long work, as convert says it after its own
        log(note)
    memory_plan = _memory_plan(cfg, mapping, options, log)
    forced = dict(options.tactics)
    for op in set(forced) - set(PLUGIN_OPS):
        raise BuildError(f"--tactic {op}={forced[op]}: {op!r} is not a plugin op; they are {', '.join(PLUGIN_OPS)}")
    try:
        plugins, notes = resolve_plugins(options.target, forced, quantization=cfg.quantization.method,
                                         dtype=options.dtype)
    except (KeyError, ValueError) as e:
        flag = "--tactic " + " ".join(f"{k}={v}" for k, v in forced.items()) if forced else f"--target {options.target}"
        raise BuildError(f"{flag}: {e}") from None
    if plugins.get("MoEExperts", {}).get("tactic") in W4_TACTICS:
        max_scale = _max_expert_scale(converted_dir, mapping, progress)
        fit = fit_moe_tactic(plugins, (cfg.expert_hidden_size, cfg.moe_intermediate_size // mapping.moe_tp_size),
                             max_scale, latent=cfg.is_latent_moe)
        if fit and "MoEExperts" in forced:  # a tactic the user asked for is refused, not silently replaced
            raise BuildError(f"--tactic MoEExperts={forced['MoEExperts']}: cannot read this checkpoint's experts: "
                             + "; ".join(fit))
        notes += fit
    fit = fit_mla_tactic(plugins, cfg.num_attention_heads // mapping.attn_tp_size, cfg.kv_lora_rank,
                         cfg.qk_rope_head_dim)
    if fit and "MLA" in forced:  # as for the MoE: a tactic the user asked for is refused, not replaced
        raise BuildError(f"--tactic MLA={forced['MLA']}: " + "; ".join(fit))
    notes += fit
    tuning = {}
    if options.tune and plugins.get("MoEExperts", {}).get("tactic") in RELAID_W4 and "MoEExperts" not in forced:
        note, tuning = _tune_fp8(cfg, mapping, converted_dir, plugins, options.torch_dtype)
        notes.append(note)
    for note in notes:
        log(note)
    layout = expert_layout(plugins)
    # one id for this build, in its config's stamp and in every rank's weights: the runtime refuses ranks (or rank
    # files) of different builds, which would run together and generate nonsense
    build_id = uuid.uuid4().hex
    with staged_output(engine_dir, BuildError) as tmp:
        ranks = {}
        for rank in range(mapping.world_size):
            ranks[str(rank)] = _build_rank(cfg, mapping, rank, converted_dir, tmp, options, progress, layout,
                                           build_id)
        for name in TOKENIZER_FILES:
            if (converted_dir / name).exists():
                shutil.copy2(converted_dir / name, tmp / name)
        config = {
            "version": ENGINE_FORMAT_VERSION,
            "pretrained_config": cfg.to_dict(),
            "mapping": mapping.to_dict(),
            "build_config": {**options.to_dict(), "plugins": plugins, "plugin_notes": notes, "tuning": tuning},
            "stamp": {**stamp_for(options.target), "build_id": build_id},
            "ranks": ranks,
            "memory_plan": memory_plan,
            "generation_config": generation,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
    return engine_dir


def _build_rank(cfg: K3Config, mapping: Mapping, rank: int, converted_dir: Path, out: Path, options: BuildOptions,
                progress: bool, layout: str, build_id: str) -> dict:
    """Writes rank{rank}/ (MXFP4 experts in `layout`, see tactics.expert_layout) and returns its rank-table entry."""
    rank_dir = out / f"rank{rank}"
    rank_dir.mkdir()
    writer = SafetensorsWriter(rank_dir / "weights.safetensors",
                               metadata={"format": "k3engine", "rank": str(rank), "build_id": build_id})
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    src_path = converted_dir / f"rank{rank}.safetensors"
    with safe_open(src_path, framework="pt") as src:
        keys = set(src.keys())

        def get(name: str) -> torch.Tensor:
            if name not in keys:
                raise BuildError(f"{src_path}: tensor {name!r} missing (needed by the layout pass for rank {rank})")
            t = src.get_tensor(name)
            # convert refuses these: a file changed after it would give NaN logits, and the runtime's load check
            # (which sees only the engine's bytes) would ask for a rebuild that gives them again
            again = ("which convert refuses (the file changed after it, or an older k3build converted it): convert "
                     "again")
            if t.is_floating_point() and first_nonfinite(t) is not None:
                raise BuildError(f"{src_path}: tensor {name!r} holds NaN or Inf, {again}")
            if name.endswith(".weight_scale"):
                try:
                    check_scale(t, f"{src_path}: tensor {name!r}")
                except MXFP4Error as e:
                    raise BuildError(f"{e}, {again}") from None
            return t

        layers = mapping.rank_layers(rank, cfg.num_hidden_layers)
        bar = progress_bar(total=len(layers), desc=f"build rank{rank}", unit="layer", enabled=progress)
        last_layer = last_name = None
        try:
            for name, t in engine_tensors(cfg, mapping, rank, get, options.torch_dtype, expert_layout=layout):
                writer.add(name, t)
                last_name = name
                shapes[name] = (tuple(t.shape), t.dtype)
                layer = name.split(".", 1)[0]
                if layer != last_layer and layer[1:].isdigit():
                    bar.update(1)
                    last_layer = layer
        except BuildError:
            writer.abort()
            raise
        except (RuntimeError, ValueError) as e:
            # A tensor of the wrong shape for the model config (e.g. a reshape in the MLA absorption pass).
            writer.abort()
            raise BuildError(f"{src_path}: the layout pass for rank {rank} failed after {last_name!r}: {e}; "
                             f"the file does not match {converted_dir}/config.json — convert again") from None
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
    # the data goes behind the header in one more pass over the rank's bytes: as long as writing them, so shown too
    with progress_bar(total=writer.data_bytes, desc=f"write rank{rank}", unit="B", unit_scale=True,
                      unit_divisor=1024, enabled=progress) as wbar:
        writer.close(progress=wbar.update)
    model = graph_mod.build_graph(cfg, mapping, rank, shapes, options.torch_dtype, capacity=options.max_num_tokens)
    # the build's id in the graph too (as in the weights' header): a graph.onnx of another build is refused by it,
    # whatever config.json's sha256 record says (engines from before that record have none)
    onnx.helper.set_model_props(model, {"build_id": build_id})
    onnx.save(model, rank_dir / "graph.onnx")
    return {
        "pp_rank": mapping.pp_rank(rank), "tp_rank": mapping.tp_rank(rank), "layers": [layers.start, layers.stop],
        "experts": _range(mapping.local_experts(rank, cfg.num_experts)), "tp_group": mapping.tp_group(rank),
        "pp_group": mapping.pp_group(rank), "moe_group": mapping.tp_group(rank),
        "first_stage": mapping.is_first_stage(rank), "last_stage": mapping.is_last_stage(rank),
        "weight_bytes": (rank_dir / "weights.safetensors").stat().st_size,
        # what the runtime checks the files against: a byte changed since (a disk, a copy) is refused, not run
        "graph_sha256": hashlib.sha256((rank_dir / "graph.onnx").read_bytes()).hexdigest(),
        "weights_sha256": writer.sha256,
    }


def _tune_fp8(cfg: K3Config, mapping: Mapping, converted_dir: Path, plugins: dict,
              dtype: torch.dtype) -> tuple[str, dict]:
    """Switch MoEExperts to triton_f8 if, on rank 0's first MoE layer, its prefill is within the parity bar of the
    recorded W4A16 tactic and faster (tune.py); returns the note and the measured figures."""
    from .tune import first_moe_layer, fp8_trial, fp8_wins

    base = plugins["MoEExperts"]["tactic"]
    layer = first_moe_layer(cfg, mapping, converted_dir, dtype)
    if layer is None:
        return f"MoEExperts: --tune found no MoE layer on rank 0; keeping {base}", {}
    trial = fp8_trial(*layer, cfg, RELAID_W4[base])
    ok = fp8_wins(trial)
    if ok:
        record_tactic(plugins["MoEExperts"], "MoEExperts", "triton_f8")
    return (f"MoEExperts: FP8 prefill on rank 0's first MoE layer against {base}: rel-L2 "
            f"{trial['moe_fp8_rel']:.3g}, cosine {trial['moe_fp8_cos']:.5f} (parity bar: rel-L2 < 3e-2, cosine > "
            f"0.999), {trial['moe_fp8_prefill_ms']:.3f} ms against {trial['moe_w4a16_prefill_ms']:.3f} ms; "
            f"{'using triton_f8' if ok else 'keeping ' + base}"), trial


def _max_expert_scale(converted_dir: Path, mapping: Mapping, progress: bool) -> int | None:
    """The largest E8M0 scale byte of any routed expert in the converted checkpoint (None: no MXFP4 experts);
    read before the layout pass because it decides the MoE tactic, and so the expert layout."""
    best = None
    for rank in progress_bar(range(mapping.world_size), desc="scan expert scales", unit="rank", enabled=progress):
        with safe_open(converted_dir / f"rank{rank}.safetensors", framework="pt") as src:
            for name in src.keys():
                if ".experts." in name and name.endswith("weight_scale"):
                    m = int(src.get_tensor(name).max())
                    best = m if best is None else max(best, m)
    return best


def _range(r: range) -> list[int]:
    return [r.start, r.stop]


def _memory_plan(cfg: K3Config, mapping: Mapping, options: BuildOptions, log: Callable[[str], None]) -> dict:
    """Cache sizes the runtime starts with, and a refusal, with numbers, when the limits cannot fit the budget.
    Without a budget the limits alone size the caches: their bytes are logged, and refused past MAX_GIB."""
    pages_per_seq = math.ceil(options.max_seq_len / options.page_size)
    plan = {"num_slots": options.max_batch_size, "num_pages": options.max_batch_size * pages_per_seq,
            "page_size": options.page_size}
    if options.gpu_memory_gib is None:
        worst = max(plan["num_slots"] * kda_state_bytes(cfg, mapping, r, options.state_dtype, options.dtype)
                    + plan["num_pages"] * options.page_size
                    * kv_bytes_per_token(cfg, mapping, r, DTYPES[options.kv_dtype].itemsize)
                    for r in range(mapping.world_size))
        what = (f"{plan['num_slots']} KDA slots and {plan['num_pages']} MLA pages (--max-batch-size "
                f"{options.max_batch_size} requests of --max-seq-len {options.max_seq_len} tokens) take "
                f"{size_text(worst)} on the largest rank")
        if worst > MAX_GIB * GiB:
            raise BuildError(f"{what}: lower the limits, or give --gpu-memory-gib to size them by a budget")
        log(f"no --gpu-memory-gib: {what}; the runtime allocates them at load")
        return plan
    try:
        mp = plan_memory(cfg, mapping, max_seq_len=options.max_seq_len, **options.plan_limits())
    except ValueError as e:
        raise BuildError(f"memory plan: {e}") from None
    if not mp.fits:
        raise BuildError(f"the engine does not fit in --gpu-memory-gib {options.gpu_memory_gib} per rank: {mp.reason}")
    # Every rank gets the same cache sizes: those of the rank with the least room, never more than the limits use.
    # (A rank without KDA or MLA layers holds no slots or pages and sets no bound.)
    plan["num_slots"] = min([plan["num_slots"]] + [r.kda_slots for r in mp.ranks if r.kda_state_bytes_per_request])
    plan["num_pages"] = min([plan["num_pages"]] + [r.kv_pages for r in mp.ranks if r.page_bytes])
    if plan["num_slots"] < options.max_batch_size:
        # the user's batch size is not what the engine runs: say so, with the way out
        short = min((r for r in mp.ranks if r.kda_state_bytes_per_request), key=lambda r: r.kda_slots)
        full = plan["num_pages"] // pages_per_seq
        log(f"--max-batch-size {options.max_batch_size}: --gpu-memory-gib {options.gpu_memory_gib} holds "
            f"{plan['num_slots']} KDA slots (rank {short.rank}: {size_text(short.free_bytes)} free after weights and "
            f"reserve, {size_text(short.kda_state_bytes_per_request)} a slot) and {plan['num_pages']} pages, so at "
            f"most {plan['num_slots']} requests run at once, {full} of them of --max-seq-len "
            f"{options.max_seq_len}; raise the budget or lower --max-batch-size")
    return {**plan, "budget": mp.to_dict()}
