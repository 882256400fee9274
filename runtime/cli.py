"""`k3runtime` command line: generate from an engine (servers and stores register here too)."""

from __future__ import annotations

import importlib
import json
import re
import sys

import click

from .engine_flags import (as_options, device_option, engine_flags, given, use_weight_config,
                           weight_config_option)
from .loader import EngineError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="k3build")  # one distribution holds k3build, k3runtime and k3plugins
def main():
    """Run k3build engines."""


@main.command("generate")
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeat for a batch).")
@click.option("--prompt-file", type=click.File("r", encoding="utf-8"), default=None,
              help='JSONL file of prompts, one {"prompt": "..."} object a line (after any --prompt); - reads stdin.')
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Tokens to generate a prompt, at most.")
@click.option("--temperature", type=float, default=None,
              help="0 = greedy. [default: the model's generation_config.json, else 0]")
@click.option("--top-p", type=float, default=None, help="In (0, 1]; 1 = off. [default: generation_config.json, else 1]")
@click.option("--top-k", type=int, default=None, help="0 = off. [default: generation_config.json, else 0]")
@click.option("--min-p", type=float, default=None,
              help="In [0, 1]: drop tokens less likely than this times the most likely one; 0 = off. "
                   "[default: generation_config.json, else 0]")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None,
              help="Seed of the sampling draws (none: a random one).")
@click.option("--n", "n", type=int, default=1, show_default=True,
              help="Completions of each prompt, one after another (choice j seeded --seed + j when given).")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True, help="In [-2, 2]; 0 = off.")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True, help="In [-2, 2]; 0 = off.")
@click.option("--repetition-penalty", type=float, default=None,
              help="> 0; 1 = off. [default: generation_config.json, else 1]")
@click.option("--ignore-eos", is_flag=True, help="Generate past the end-of-sequence token, to --max-tokens (timing).")
@device_option
@click.option("--stream/--no-stream", default=False, help="Print tokens as they come (one prompt).")
@weight_config_option
@engine_flags
def generate_cmd(engine, prompts, prompt_file, max_tokens, temperature, top_p, top_k, min_p, seed, n, presence_penalty,
                 frequency_penalty, repetition_penalty, ignore_eos, device, stream, distributed_weight_config,
                 **flags):
    """Generate completions for the --prompt texts and the --prompt-file's."""
    use_weight_config(distributed_weight_config)
    from .api import LLM
    from .engine_options import EngineOptions, cache_sizes, check_prompt
    from .loader import default_device, read_engine_config
    from .sampling_params import SamplingParams
    from .tokenizer import load_tokenizer

    # (where each prompt came from, as its errors name it; the prompt)
    sources = [("--prompt", p) for p in prompts] + (_read_prompts(prompt_file) if prompt_file is not None else [])
    prompts = [p for _, p in sources]
    if not prompts:
        raise click.UsageError("no prompts: give --prompt TEXT (repeatable) or --prompt-file FILE (- for stdin)")
    if stream and (len(prompts) > 1 or n > 1):
        raise click.UsageError(f"--stream prints one completion as it comes; got {len(prompts)} prompts and --n {n}")
    try:
        # the tokenizer and the prompts before the engine loads: what it would refuse costs no weight reading
        config = read_engine_config(engine)
        device = device or default_device(config)
        # a flag left out: the model's generation_config.json value (LLMEngine.sampling_defaults), else greedy
        chosen = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                                   ("min_p", min_p), ("repetition_penalty", repetition_penalty)) if v is not None}
        sampling = {"temperature": 0.0, **(config.get("generation_config") or {}).get("sampling", {}), **chosen}
        params = SamplingParams(max_tokens=max_tokens, seed=seed, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, n=n, ignore_eos=ignore_eos, **sampling)
        tokenizer = load_tokenizer(engine)
        if tokenizer is None:
            raise click.ClickException(f"{engine}: the engine has no tokenizer.json (its checkpoint had none, or it "
                                       "was removed), and generate takes text; build from a checkpoint with its "
                                       "tokenizer, or give token ids through the Python API (LLM.generate) or the "
                                       "server")
        prompt_ids = [tokenizer.encode(p) for p in prompts]
        num_pages = cache_sizes(config, EngineOptions(device=device, **given(flags)))[0]
        for (where, _), ids in zip(sources, prompt_ids):
            try:
                check_prompt(config, ids, max_tokens=max_tokens, num_pages=num_pages)
            except ValueError as e:
                raise click.ClickException(_prompt_error(str(e), where)) from None
        max_len = config["build_config"]["max_seq_len"]
        longest = max(map(len, prompt_ids))
        if longest + max_tokens > max_len:  # the API stops there ("length"); the server refuses such a request
            click.echo(f"note: --max-tokens {max_tokens} runs past the engine's max_seq_len {max_len}: an output stops "
                       f"where its prompt and output reach {max_len} tokens", err=True)
        llm = LLM(engine, device=device, tokenizer=tokenizer, load_progress=True, **given(flags))
        if stream:
            for chunk in llm.stream(prompt_ids[0], params):
                click.echo(chunk.text, nl=False)
            click.echo()
            return
        for prompt, out in zip([p for p in prompts for _ in range(n)], llm.generate(prompt_ids, params)):
            choice = f" [choice {out.index}]" if n > 1 else ""
            click.echo(f"--- {prompt!r}{choice} -> {len(out.token_ids)} tokens ({out.finish_reason})")
            click.echo(out.text if out.text is not None else out.token_ids)
    except (EngineError, ValueError) as e:
        raise click.ClickException(_prompt_error(str(e), "--prompt")) from None


def _prompt_error(message: str, where: str) -> str:
    """An API error as this command's user reads it: options by their flags, and the API's prompt field by where the
    prompt came from (--prompt, or --prompt-file FILE:LINE), as tokens."""
    # (a function as the replacement: a file name's backslashes stay as they are)
    return re.sub(r"^prompt_token_ids:", lambda _: f"{where} (as tokens):", as_options(message))


def _read_prompts(file) -> list[tuple[str, str]]:
    """--prompt-file's prompts, each with where it is ("--prompt-file FILE:LINE", how its errors name it): each
    non-blank line a JSON object whose "prompt" is the text (JSONL, as batch inference files are: a prompt may hold
    newlines; a UTF-8 BOM, as Windows editors write, is skipped); UsageError naming the file and line of one that is
    not."""
    name = "stdin" if file.name == "<stdin>" else file.name
    prompts = []
    try:
        lines = list(file)
    except UnicodeDecodeError as e:
        raise click.UsageError(f"--prompt-file {name}: not UTF-8 text ({e})") from None
    if lines and lines[0].startswith("\ufeff"):  # the BOM of a file saved as "UTF-8 with BOM"
        lines[0] = lines[0][1:]
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise click.UsageError(f"--prompt-file {name}:{n}: not valid JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise click.UsageError(f'--prompt-file {name}:{n}: expected an object with a "prompt" string, '
                                   f"got {line.strip()[:80]}")
        prompts.append((f"--prompt-file {name}:{n}", row["prompt"]))
    if not prompts:
        raise click.UsageError(f"--prompt-file {name}: no prompts in it")
    return prompts


# (module, command attribute) of commands living beside their code.
COMMANDS = [
    ("k3runtime.server.cli", "serve_cmd"),
    ("k3runtime.triton_backend.repo", "triton_repo_cmd"),
    ("k3runtime.dist.weight_store", "weight_store_cmd"),
]
for _module, _attr in COMMANDS:
    try:
        main.add_command(getattr(importlib.import_module(_module), _attr))
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("k3runtime"):
            print(f"k3runtime: {_module} unavailable ({e})", file=sys.stderr)


if __name__ == "__main__":
    main()
