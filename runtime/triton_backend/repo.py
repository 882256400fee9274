"""`k3runtime triton-repo ENGINE OUT`: write a Triton model repository (config.pbtxt + 1/model.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import click
import torch

from ..engine_flags import as_options, device_option, engine_flags, given, sequence_limits, to_params
from ..engine_options import EngineOptions, check_build_limits
from ..loader import EngineError, check_device_kind, default_device, read_engine_config

_INPUTS = [  # (name, Triton type, dims); all optional so a client sends only what it sets
    ("text_input", "TYPE_STRING", [1]),
    ("input_ids", "TYPE_INT32", [-1]),
    ("max_tokens", "TYPE_INT32", [1]),
    ("temperature", "TYPE_FP32", [1]),
    ("top_p", "TYPE_FP32", [1]),
    ("top_k", "TYPE_INT32", [1]),
    ("min_p", "TYPE_FP32", [1]),
    ("seed", "TYPE_UINT64", [1]),
    ("stream", "TYPE_BOOL", [1]),
    ("stop", "TYPE_STRING", [-1]),
    ("return_log_probs", "TYPE_BOOL", [1]),
    ("presence_penalty", "TYPE_FP32", [1]),
    ("frequency_penalty", "TYPE_FP32", [1]),
    ("repetition_penalty", "TYPE_FP32", [1]),
    ("min_tokens", "TYPE_INT32", [1]),
    ("ignore_eos", "TYPE_BOOL", [1]),
    ("stop_token_ids", "TYPE_INT32", [-1]),
    ("skip_special_tokens", "TYPE_BOOL", [1]),
]
_OUTPUTS = [("text_output", "TYPE_STRING", [-1]), ("output_ids", "TYPE_INT32", [-1]),
            ("finish_reason", "TYPE_STRING", [1]), ("output_log_probs", "TYPE_FP32", [-1])]


def _tensor(name, dtype, dims, *, optional=False, ragged=False):
    opt = "\n    optional: true" if optional else ""
    opt += "\n    allow_ragged_batch: true" if ragged else ""
    return f'  {{\n    name: "{name}"\n    data_type: {dtype}\n    dims: {json.dumps(dims).replace(",", ", ")}{opt}\n  }}'


def config_pbtxt(model_name: str, engine_dir: Path, *, decoupled: bool, device: str = "cpu",
                 max_tokens_limit: int = 4096, max_batch_size: int = 0, **flags) -> str:
    """max_batch_size: for the unary model (not decoupled), how many requests Triton's dynamic batcher may hand the
    model at once (the engine's max_num_seqs); 0 = one at a time.
    flags: engine_flags' options (num_pages=…, async_scheduling=…); one left out or None is the engine's
    (params.engine_options reads the parameters). Refused here as EngineOptions refuses them (ValueError; TypeError
    for a keyword that is no flag), not when tritonserver loads the model."""
    EngineOptions(device=device, **given(flags))
    params = {"engine_dir": str(engine_dir), "device": device, "max_tokens_limit": str(max_tokens_limit),
              **to_params(flags)}
    # The decoupled model takes each request as it comes (the engine batches continuously). The unary one must
    # answer from execute, so requests that wait while it runs come in together through the dynamic batcher
    # (each keeps its own tensors, with a batch dimension of 1; ragged: prompts of any length go together).
    batch = 0 if decoupled else max_batch_size
    lines = [f'name: "{model_name}"', 'backend: "python"', f"max_batch_size: {batch}"]
    if decoupled:
        lines.append("model_transaction_policy {\n  decoupled: true\n}")
    elif batch:
        lines.append("dynamic_batching {\n}")
    lines.append("input [\n" + ",\n".join(_tensor(*t, optional=True, ragged=batch > 0 and t[2] == [-1])
                                           for t in _INPUTS) + "\n]")
    lines.append("output [\n" + ",\n".join(_tensor(*t) for t in _OUTPUTS) + "\n]")
    kind = "KIND_CPU" if device == "cpu" else "KIND_MODEL"  # KIND_MODEL: the engine places itself on its device
    lines.append(f"instance_group [\n  {{\n    count: 1\n    kind: {kind}\n  }}\n]")
    for k, v in params.items():
        lines.append(f'parameters {{\n  key: "{k}"\n  value: {{ string_value: {json.dumps(v)} }}\n}}')
    return "\n".join(lines) + "\n"


def write_repo(engine_dir: str | Path, out: str | Path, *, model_name: str = "k3", decoupled: bool = True,
               device: str | None = None, max_tokens_limit: int | None = None, overwrite: bool = False,
               **flags) -> Path:
    """Write OUT/MODEL/{config.pbtxt, 1/model.py}; returns the model dir. Other models in OUT are kept.
    device: the model's (None: the engine target's, loader.default_device);
    max_tokens_limit: a request's max_tokens at most (None: the engine's max_seq_len, as `serve`);
    flags: as config_pbtxt's."""
    engine_dir = Path(engine_dir).resolve()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", model_name) or model_name in (".", ".."):
        raise ValueError(f"model_name: {model_name!r} is not a Triton model name (letters, digits, '_', '.', '-'): "
                         "it names a directory of the repository")
    if not (engine_dir / "config.json").is_file():
        raise FileNotFoundError(f"{engine_dir}: not a k3build engine (no config.json)")
    # the config first: bad flags leave OUT as it was
    engine_config = read_engine_config(engine_dir)
    device = device or default_device(engine_config)
    check_build_limits(EngineOptions(device=device, **given(flags)), engine_config, engine_dir)
    # the kind only: the repository may be written on a host without the engine's GPU (its server's has it)
    check_device_kind(engine_config, engine_dir / "config.json", torch.device(device))
    out_dir = Path(out).resolve()
    if out_dir == engine_dir or engine_dir in out_dir.parents:  # files k3build did not write: a rebuild refuses them
        raise ValueError(f"{out}: inside the engine {engine_dir}; write the repository beside it "
                         "(k3build build --overwrite refuses an engine dir holding files of others)")
    _, max_tokens_limit = sequence_limits(engine_config, max_tokens_limit=max_tokens_limit)
    config = config_pbtxt(model_name, engine_dir, decoupled=decoupled, device=device, max_tokens_limit=max_tokens_limit,
                          max_batch_size=flags.get("max_num_seqs") or engine_config["build_config"]["max_batch_size"],
                          **flags)
    model_dir = Path(out) / model_name
    if model_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{model_dir}: exists (pass --overwrite to replace it)")
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(config)
    shutil.copyfile(Path(__file__).with_name("model.py"), model_dir / "1" / "model.py")
    return model_dir


@click.command("triton-repo")
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--model-name", default="k3", show_default=True, help="The model's name in the repository.")
@click.option("--decoupled/--no-decoupled", default=True, show_default=True,
              help="Decoupled = streaming (gRPC stream / generate_stream); --no-decoupled = one response per request "
                   "(for /infer clients; requests that arrive while a batch runs wait for it).")
@device_option
@click.option("--max-tokens-limit", type=click.IntRange(min=1), default=None,
              help="Cap on a request's max_tokens [the engine's max_seq_len].")
@engine_flags
@click.option("--overwrite", is_flag=True, help="Replace OUT/MODEL_NAME if it exists (other models are kept).")
def triton_repo_cmd(engine, out, model_name, decoupled, device, max_tokens_limit, overwrite, **flags):
    """Write a Triton Python-backend model repository serving ENGINE into OUT."""
    try:
        d = write_repo(engine, out, model_name=model_name, decoupled=decoupled, device=device,
                       max_tokens_limit=max_tokens_limit, overwrite=overwrite, **flags)
    except (FileNotFoundError, FileExistsError, ValueError, EngineError) as e:
        raise click.ClickException(as_options(str(e))) from None
    click.echo(f"wrote {d} (start: tritonserver --model-repository={Path(out).resolve()})")
