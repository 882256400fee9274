"""argparse types of the dev tools' flags: a bad value is a usage error naming the flag (exit status 2), not a
traceback from deep inside the run."""

import argparse


def count(text: str) -> int:
    """An int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {text!r}")
    return value


def counts(text: str) -> list[int]:
    """Comma-separated ints >= 1 ("32,64,128")."""
    try:
        return [count(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected counts >= 1, comma separated (32,64), got {text!r}") from None
