"""The engine's scheduling and cache options (EngineOptions) as command-line options of `generate`, `serve` and
`triton-repo`, and as the Triton model's string parameters: one table, so that the three commands and the backend
take the same names, and a bad value is refused by the name it was given under."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import click

from .engine_options import ASYNC_SCHEDULING_DEFAULT
from .scheduler_config import PREEMPTION_MODES


@dataclass(frozen=True)
class Flag:
    field: str  # EngineOptions' field; the option is --field-with-dashes, the Triton parameter the field
    help: str
    minimum: int = 1  # an int flag's least value
    choices: tuple[str, ...] = ()  # a choice flag's values
    boolean: bool = False  # an on/off flag: --field / --no-field
    number: bool = False  # a number > 0, not only an int

    @property
    def option(self) -> str:
        return "--" + self.field.replace("_", "-")

    def click_option(self):
        if self.boolean:
            return click.option(f"{self.option}/--no-{self.option[2:]}", self.field, default=None, help=self.help)
        if self.number:
            kind = click.FloatRange(min=0, min_open=True)
        else:
            kind = click.Choice(self.choices) if self.choices else click.IntRange(min=self.minimum)
        return click.option(self.option, self.field, type=kind, default=None, help=self.help)

    def parse(self, text: str):
        """A Triton parameter's string as the option's value; ValueError names the parameter."""
        where = f"config.pbtxt: parameter {self.field}"
        if self.boolean:
            if text.lower() not in ("true", "false"):
                raise ValueError(f"{where} must be true or false, got {text!r}")
            return text.lower() == "true"
        if self.number:
            try:
                value = float(text)
            except ValueError:
                value = None
            if value is None or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{where} must be a number > 0, got {text!r}")
            return value
        if self.choices:
            if text not in self.choices:
                raise ValueError(f"{where} must be one of {', '.join(self.choices)}, got {text!r}")
            return text
        if not (text.isascii() and text.isdigit() and int(text) >= self.minimum):
            raise ValueError(f"{where} must be an integer >= {self.minimum}, got {text!r}")
        return int(text)


FLAGS = (
    Flag("num_pages", "MLA cache pages [the engine's memory plan]."),
    Flag("num_slots", "KDA state slots, one a running request [the engine's memory plan]."),
    Flag("max_num_seqs", "Requests running at once at most [the engine's max batch size]."),
    Flag("max_num_batched_tokens", "Tokens in one step at most [the engine's max tokens]."),
    Flag("max_prefill_chunk", "Prompt tokens of one request in one step at most (chunked prefill) [the engine's "
                              "max tokens]."),
    Flag("preemption_mode", "What a request preempted for lack of pages loses: recompute (its cache, prefilled "
                            "again later) or swap (copied to a host store and back) [recompute].",
         choices=PREEMPTION_MODES),
    Flag("swap_space_gib", "Host memory in GiB a rank gives --preemption-mode swap: its host store of as many pages "
                           "and KDA slots as fit, in the device cache's mix (instead of --num-host-pages and "
                           "--num-host-slots).", number=True),
    Flag("num_host_pages", "Host-store pages for --preemption-mode swap [0].", minimum=0),
    Flag("num_host_slots", "Host-store KDA slots for --preemption-mode swap [0].", minimum=0),
    Flag("pp_micro_batches", "Pipeline stages: cut every step of several sequences into this many micro-batches, "
                             "at most pp_size, so that the stages overlap (1: never cut) [the count an estimate of "
                             "the step's time favours: runtime/micro_batch.py]."),
    Flag("verify_weights", "Hash every byte of the rank's weights file as it is read, against the sha256 its build "
                           "recorded: an engine copied from elsewhere is refused if one bit changed (slower load: "
                           "sha256 runs on one core, about 1 GB/s) [off].", boolean=True),
    Flag("async_scheduling", "Launch each step before the previous step's tokens reach the host, so that the GPU "
                             f"does not wait for it between decode steps. Default: {ASYNC_SCHEDULING_DEFAULT}.",
         boolean=True),
)
_FIELDS = {f.field for f in FLAGS}


def engine_flags(fn):
    """The command takes every flag of FLAGS as a keyword (None when not given)."""
    for flag in reversed(FLAGS):
        fn = flag.click_option()(fn)
    return fn


def given(values: dict) -> dict:
    """The flags given (not None) out of a command's keywords: EngineOptions' keywords. TypeError for a keyword
    that is no flag (a misspelling would otherwise be dropped)."""
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        raise TypeError(f"not engine flags: {unknown}; the flags are {sorted(_FIELDS)}")
    return {k: v for k, v in values.items() if v is not None}


# fields the commands take as options of the same name besides the engine flags (sampling, the device): named
# by their option only where an error starts with them ("top_p: expected ..."), as several are plain words too
COMMAND_FIELDS = ("device", "model_name", "max_prompt_tokens", "max_tokens_limit", "max_tokens", "temperature",
                  "top_p", "top_k", "min_p", "seed", "n", "presence_penalty", "frequency_penalty", "repetition_penalty")


def as_options(message: str) -> str:
    """An EngineOptions or SamplingParams error as a command-line user reads it: each field named by its option
    (--num-host-pages, --max-tokens); not inside a longer name, an attribute or a path (/k3-num_pages/)."""
    option = lambda m: "--" + m.group(1).replace("_", "-")  # noqa: E731
    fields = "|".join(map(re.escape, _FIELDS))
    message = re.sub(rf"(?<![\w/.-])({fields})(?![\w/-])", option, message)
    return re.sub(rf"^({'|'.join(map(re.escape, COMMAND_FIELDS))}):", lambda m: option(m) + ":", message)


def sequence_limits(config: dict, max_prompt_tokens: int | None = None,
                    max_tokens_limit: int | None = None) -> tuple[int, int]:
    """(a request's prompt tokens at most, its max_tokens at most) for a server of the engine whose config.json is
    `config`: the values given, by default what its max_seq_len holds. ValueError for a value past that."""
    max_len = config["build_config"]["max_seq_len"]
    limits = []
    for field, value, most in (("max_prompt_tokens", max_prompt_tokens, max_len - 1),
                               ("max_tokens_limit", max_tokens_limit, max_len)):
        if value is not None and value > most:
            raise ValueError(f"{field}: {value} is past what the engine holds, {max_len} tokens a sequence (its "
                             f"max_seq_len), so at most {most}")
        limits.append(value or most)
    return limits[0], limits[1]


def from_params(params: dict[str, str]) -> dict:
    """The flags set in a Triton model's parameters (non-empty strings), parsed."""
    return {f.field: f.parse(params[f.field]) for f in FLAGS if params.get(f.field)}


def to_params(values: dict) -> dict[str, str]:
    """The flags given, as Triton parameters (from_params reads them back)."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in given(values).items()}


def device_option(fn):
    """`--device` (generate, serve, triton-repo); left out, the command takes loader.default_device's."""
    return click.option("--device", default=None, help="cpu, cuda or cuda:N [the engine's target's: cuda for an sm90 "
                                                      "or gfx942 engine, else cpu].")(fn)


def weight_config_option(fn):
    """`--distributed-weight-config FILE` (generate, serve); use_weight_config applies it."""
    return click.option("--distributed-weight-config", type=click.Path(exists=True, dir_okay=False), default=None,
                        help="JSON/TOML file: which node's `k3runtime weight-store` holds which ranks; ranks attach "
                             "to it instead of reading disk (same as $K3_WEIGHT_STORE_CONFIG).")(fn)


def use_weight_config(path: str | None) -> None:
    """Check the file (BadParameter names what is wrong) and export it: the loader attaches each rank's weights
    from its node's store (under torchrun, dist.launch exports the same variable on every rank before they load)."""
    if not path:
        return
    from .dist.weight_store_client import ENV_CONFIG, WeightStoreConfig, WeightStoreError

    try:
        WeightStoreConfig.load(Path(path).resolve())
    except WeightStoreError as e:
        raise click.BadParameter(str(e), param_hint="--distributed-weight-config") from None
    os.environ[ENV_CONFIG] = str(Path(path).resolve())
