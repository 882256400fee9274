"""A Hugging Face checkpoint's generation_config.json: the EOS ids and sampling defaults the engine records.

transformers writes `eos_token_id` as an int or a list (a chat model's end of turn beside its end of text), and
the sampling fields are what its `generate` uses when the caller gives none; vLLM's generation_config="auto"
stops on every EOS id and takes the sampling fields as its request defaults (not `do_sample`, which it ignores
too). convert checks the file (a bad value is refused before hours of conversion) and build records what it says
in the engine's config.json ("generation_config"), so the runtime reads no Hugging Face file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FILE = "generation_config.json"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# the sampling fields taken as defaults (SamplingParams' names and ranges): field -> (accepts, what it expects)
SAMPLING = {
    "temperature": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _int(v) and v >= -1, "an int >= 0 (0 or -1 = off)"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1] (0 = off)"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a finite number > 0 (1 = off)"),
}


def read_generation_config(ckpt_dir: Path, vocab_size: int, error: type[Exception]) -> dict:
    """{"eos_token_ids": [...], "sampling": {field: value}} of ckpt_dir's generation_config.json ({} when there is
    none; a null field is an absent one); `error` naming the file and the field for a value the engine cannot use."""
    path = Path(ckpt_dir) / FILE
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise error(f"{path}: expected a JSON object, got {type(d).__name__}")
    out: dict = {}
    eos = d.get("eos_token_id")
    if eos is not None:
        ids = [eos] if _int(eos) else eos
        if not isinstance(ids, list) or not ids or not all(_int(i) and 0 <= i < vocab_size for i in ids):
            raise error(f"{path}: eos_token_id: expected a token id in 0..{vocab_size - 1} (vocab_size) or a "
                        f"non-empty list of them, got {eos!r}")
        out["eos_token_ids"] = sorted(set(ids))
    sampling = {}
    for name, (accepts, want) in SAMPLING.items():
        value = d.get(name)
        if value is None:
            continue
        if not accepts(value):
            raise error(f"{path}: {name}: expected {want}, got {value!r}")
        sampling[name] = value
    if sampling:
        out["sampling"] = sampling
    return out
