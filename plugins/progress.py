"""Progress bars for long host work (synth, convert, build, a weight load or copy), here because the builder and the
runtime both stand on this package: tqdm on a terminal; off one (a file, a pipe, a service's journal) a plain line
every LOG_EVERY_S seconds and one at the end, each ended by a newline, and none for work that fails at once (its
error is the one line). tqdm alone writes a log one line of carriage returns that never ends (or, with
disable=None, nothing at all: a convert of a whole checkpoint silent for an hour).
"""

from __future__ import annotations

import sys

from tqdm import tqdm

LOG_EVERY_S = 30.0  # off a terminal: the seconds between two progress lines


class _Lines:
    """A file for tqdm off a terminal: each status tqdm writes ('\\r' + text + padding) becomes one line, but the
    first (tqdm's 0 % as the bar opens: in a log it says nothing the next line will not)."""

    def __init__(self, file):
        self.file, self.opened = file, False

    def write(self, text: str) -> None:
        text = text.strip("\r\n ")
        if text and self.opened:
            self.file.write(text + "\n")
        self.opened = self.opened or bool(text)

    def flush(self) -> None:
        self.file.flush()


def _is_terminal(file) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


class _LogBar(tqdm):
    """tqdm off a terminal: a `with` block that raises ends without the bar's last line (the error says it)."""

    def __exit__(self, exc_type, exc_value, traceback):
        if exc_type is not None:
            self.leave = False  # close() then clears the bar instead of printing it: nothing, in a log
        return super().__exit__(exc_type, exc_value, traceback)


def progress_bar(iterable=None, *, enabled: bool = True, file=None, **kwargs) -> tqdm:
    """tqdm(iterable, **kwargs) on `file` (default stderr) when enabled: as it is on a terminal, in lines every
    LOG_EVERY_S seconds (and the last) elsewhere."""
    file = sys.stderr if file is None else file
    enabled = enabled and file is not None  # a process without stderr (a daemon's, pythonw's) shows nothing
    if enabled and not _is_terminal(file):
        kwargs = {"mininterval": LOG_EVERY_S, "ascii": True, **kwargs}
        return _LogBar(iterable, file=_Lines(file), **kwargs)
    return tqdm(iterable, file=file, disable=not enabled, **kwargs)
