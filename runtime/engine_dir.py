"""What a directory handed to the runtime holds when it is not an engine, as advice the user can follow. No torch:
the weight store's command imports this."""

from __future__ import annotations

from pathlib import Path

from .sampling_params import GENERATION_DEFAULTS, SamplingParams

CONVERTED_FORMAT = "k3-converted/"  # the prefix of `k3build convert`'s config.json "format"


def not_an_engine(cfg: object, path: Path) -> str | None:
    """None when config.json at `path` (already parsed) is an engine's; else the error to raise."""
    where = path.parent
    if isinstance(cfg, dict) and "version" in cfg and "build_config" in cfg:
        return None
    if isinstance(cfg, dict) and str(cfg.get("format", "")).startswith(CONVERTED_FORMAT):
        return (f"{where}: a converted checkpoint, not an engine; build one from it with "
                f"`k3build build {where} ENGINE_DIR`")
    if isinstance(cfg, dict) and ("model_type" in cfg or "architectures" in cfg):
        return (f"{where}: a Hugging Face checkpoint, not an engine; run `k3build convert` on it, then "
                "`k3build build` on the result")
    return f"{path}: not an engine's config (no 'version' and 'build_config'); build an engine with `k3build build`"


def no_config(engine_dir: str | Path) -> str:
    """The error for a path holding no config.json: a file given for its directory, a rank directory given for its
    engine's, or no engine there."""
    path = Path(engine_dir)
    if path.is_file():
        return (f"{engine_dir}: a file; give the engine's directory (the one `k3build build` wrote, which holds "
                "config.json)")
    if any((path / name).is_file() for name in ("graph.onnx", "weights.safetensors")):
        parent = path.resolve().parent
        engine = f" ({parent})" if (parent / "config.json").is_file() else ""
        return (f"{engine_dir}: one rank's directory, not an engine; give the engine's directory{engine}, which holds "
                "config.json and every rank's")
    return f"{engine_dir}: not an engine dir (no config.json); build one with `k3build build`"


_INT1, _INT0 = (int, 1), (int, 0)
_DTYPES = ("fp32", "bf16", "fp16")
# what the runtime reads of an engine's config.json, section by section: (int, minimum), a tuple of the strings
# allowed, or the JSON type
ENGINE_FIELDS = {
    "mapping": {"world_size": _INT1, "tp_size": _INT1, "pp_size": _INT1, "attention_dp": bool},
    "build_config": {"max_batch_size": _INT1, "max_num_tokens": _INT1, "max_seq_len": (int, 2), "page_size": _INT1,
                     "dtype": _DTYPES, "kv_dtype": _DTYPES, "state_dtype": ("fp32", "bf16"), "plugins": dict},
    "memory_plan": {"num_pages": _INT1, "num_slots": _INT1},
    "pretrained_config": {"vocab_size": _INT1, "hidden_size": _INT1, "layer_types": list, "kda_num_heads": _INT1,
                          "kda_head_dim": _INT1, "kda_conv_size": _INT1, "kv_lora_rank": _INT1,
                          "qk_rope_head_dim": _INT0, "max_position_embeddings": _INT1, "num_experts_per_token": _INT1},
    "ranks": dict,
    "stamp": dict,
}
LAYER_TYPES = ("kda", "mla")


def _wrong(value, want) -> str | None:
    """What is wrong with value for `want` (an ENGINE_FIELDS entry), or None."""
    if isinstance(want, tuple) and want and isinstance(want[0], str):
        return None if value in want else f"expected one of {', '.join(want)}"
    if isinstance(want, tuple):
        kind, least = want
        ok = isinstance(value, kind) and not isinstance(value, bool) and value >= least
        return None if ok else f"expected an int >= {least}"
    name = {dict: "a JSON object", list: "a JSON list", bool: "true or false"}[want]
    return None if isinstance(value, want) else f"expected {name}"


def check_engine_fields(cfg: dict, path: Path) -> str | None:
    """None when the fields the runtime reads are there and of their kind (ENGINE_FIELDS; the layer types, the EOS
    and BOS ids inside the vocabulary, each plugin's entry, each rank's layers inside the model and its stage
    flags); else the error, naming the field: a config.json edited or damaged since its build."""
    rebuild = "the engine's config.json was edited or damaged; rebuild it with `k3build build`"
    for section, fields in ENGINE_FIELDS.items():
        value = cfg.get(section)
        if not isinstance(fields, dict):
            if why := _wrong(value, fields):
                return f"{path}: {section}: {why}, got {value!r}; {rebuild}"
            continue
        if not isinstance(value, dict):
            return f"{path}: {section}: expected a JSON object, got {value!r}; {rebuild}"
        for key, want in fields.items():
            if why := _wrong(value.get(key), want):
                return f"{path}: {section}.{key}: {why}, got {value.get(key)!r}; {rebuild}"
    model = cfg["pretrained_config"]
    why = _model_problem(model) or _plugins_problem(cfg["build_config"]["plugins"]) or \
        _ranks_problem(cfg["ranks"], len(model["layer_types"])) or \
        _generation_problem(cfg.get("generation_config"), model["vocab_size"])
    return f"{path}: {why}; {rebuild}" if why else None


def _model_problem(model: dict) -> str | None:
    for i, kind in enumerate(model["layer_types"]):
        if kind not in LAYER_TYPES:
            return f"pretrained_config.layer_types[{i}]: expected one of {', '.join(LAYER_TYPES)}, got {kind!r}"
    vocab = model["vocab_size"]
    for key in ("eos_token_id", "bos_token_id"):  # optional: a model without one stops on none
        value = model.get(key)
        if value is not None and (_wrong(value, _INT0) or value >= vocab):
            return f"pretrained_config.{key}: expected a token id in 0..{vocab - 1} (vocab_size) or null, got {value!r}"
    return None


def _generation_problem(gen, vocab: int) -> str | None:
    """The generation_config section (k3build/generation_config.py; engines built before it have none): EOS ids
    inside the vocabulary, sampling defaults that SamplingParams takes."""
    if gen is None:
        return None
    if not isinstance(gen, dict):
        return f"generation_config: expected a JSON object, got {gen!r}"
    ids = gen.get("eos_token_ids", [])
    if not isinstance(ids, list) or any(_wrong(i, _INT0) or i >= vocab for i in ids):
        return (f"generation_config.eos_token_ids: expected a list of token ids in 0..{vocab - 1} (vocab_size), "
                f"got {ids!r}")
    sampling = gen.get("sampling", {})
    unknown = set(sampling) - set(GENERATION_DEFAULTS) if isinstance(sampling, dict) else None
    if unknown is None or unknown:
        return f"generation_config.sampling: expected an object of {', '.join(GENERATION_DEFAULTS)}, got {sampling!r}"
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        return f"generation_config.sampling.{e}"
    return None


def _plugins_problem(plugins: dict) -> str | None:
    for op, entry in plugins.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("tactic"), str)
                and not _wrong(entry.get("version"), _INT0)):
            return f"build_config.plugins.{op}: expected {{\"version\": int, \"tactic\": str}}, got {entry!r}"
    return None


def _ranks_problem(ranks: dict, layers: int) -> str | None:
    for rank, info in ranks.items():
        span = info.get("layers") if isinstance(info, dict) else None
        if not (isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span)
                and 0 <= span[0] <= span[1] <= layers):
            return f"ranks.{rank}.layers: expected [start, stop] within the model's {layers} layers, got {span!r}"
        for key in ("first_stage", "last_stage"):
            if why := _wrong(info.get(key), bool):
                return f"ranks.{rank}.{key}: {why}, got {info.get(key)!r}"
    return None
