"""argparse types of the dev tools' flags: a bad value is a usage error naming the flag (exit status 2), not a
traceback from deep inside the run."""

import argparse
from pathlib import Path


def count(text: str) -> int:
    """An int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {text!r}")
    return value


def gib(text: str) -> float:
    """A size in GiB, > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a size > 0, got {text!r}")
    return value


def engine_dir(text: str) -> Path:
    """A `k3build build` output: a directory with its config.json."""
    if not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: not an engine dir (no config.json; `k3build build` writes one)")
    return Path(text)


def counts(text: str) -> list[int]:
    """Comma-separated ints >= 1 ("32,64,128")."""
    try:
        return [count(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected counts >= 1, comma separated (32,64), got {text!r}") from None
