"""The frame of a command that writes one output through staged_output (synth, convert, build): how it ends when
something goes wrong or it is stopped, the same for each."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from .output_dir import os_error_message


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwinding as Ctrl-C does so that the staging dir goes on the way out; the exit status is 143."""


def _raise_terminated(signum, frame):
    raise Terminated


@contextmanager
def writing_command(name: str, out: str | Path, errors: tuple[type[Exception], ...],
                    os_error: Callable[[OSError], str] | None = None) -> Iterator[None]:
    """`with writing_command("convert", OUT, (ConvertError, ...)):` run the command's work. `errors` and OSError
    (the output's disk full or gone meanwhile; `os_error` words it, else it is OUT that could not be written) end
    as one-line click errors; Ctrl-C and SIGTERM say OUT was not written and exit 130 / 143. By then staged_output
    has removed its staging dir."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except errors as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(os_error(e) if os_error else os_error_message(Path(out), "be written", e)) from None
    except KeyboardInterrupt as e:
        click.echo(f"\n{name} interrupted; {out} was not written", err=True)
        sys.exit(128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT))
    finally:
        signal.signal(signal.SIGTERM, previous)
