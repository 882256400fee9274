"""Where k3build's commands write: convert and build never over their own input, --overwrite replaces only
k3build's own output of that kind or an empty directory (anything else at OUT is the user's to remove), and a
finished output moves into place whole."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def config_of(path: Path) -> dict:
    """path/config.json parsed, or {} when it is missing or not a JSON object."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def check_output_dir(out: Path, src: Path, *, overwrite: bool, ours: Callable[[dict], bool], what: str,
                     error: type[Exception]) -> None:
    """`error` when writing `out` (built from `src`) would replace the input or something that is not `what`.

    ours: whether an existing out's config.json (config_of) is k3build's `what`."""
    out_r, src_r = out.resolve(), src.resolve()
    if out_r == src_r or out_r in src_r.parents:
        raise error(f"{out}: is or holds the input {src}; write the output elsewhere")
    if not out.exists():
        return
    if not overwrite:
        raise error(f"{out}: already exists; pass --overwrite to replace it")
    if out.is_dir() and not any(out.iterdir()):
        return
    if not out.is_dir() or not ours(config_of(out)):
        raise error(f"{out}: not {what}, so --overwrite leaves it alone (it replaces only k3build's own output or an "
                    "empty directory); remove it yourself or pick another path")


def os_error_message(out: Path, doing: str, e: OSError) -> str:
    """`out: cannot <doing> (<why>: <path>)` for an OSError met writing out."""
    why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or str(e)
    return f"{out}: cannot {doing} ({why}{f': {e.filename}' if e.filename else ''})"


def make_parent(out: Path, error: type[Exception]) -> None:
    """out's parent directories, made where missing; `error` where they cannot be (a file in the way, no
    permission), before any work is done."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(os_error_message(out, f"make its directory {out.parent}", e)) from None


def new_staging_dir(out: Path, error: type[Exception]) -> Path:
    """An empty directory beside `out` to write it in (named for this process: convert's clean-up of a dead run's
    reads the pid back), with the permissions of any new directory (mkdtemp makes it private); `error` where
    out's directory takes no new entry."""
    try:
        staging = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise error(os_error_message(out, f"write beside it in {out.parent}", e)) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    return staging


def move_into_place(staging: Path, out: Path, error: type[Exception]) -> None:
    """Rename the finished `staging` (a sibling of out, so the rename is atomic) to `out`; an existing out is moved
    aside first and then removed, so that out is never a mix of the old and the new. `error` where a rename is
    refused (the old out is back in place then; the caller removes staging)."""
    try:
        if not out.exists():
            os.replace(staging, out)
            return
        old = staging.with_name(staging.name + "-old")
        os.replace(out, old)
        try:
            os.replace(staging, out)
        except OSError:
            os.replace(old, out)
            raise
    except OSError as e:
        raise error(os_error_message(out, "put the finished output in place", e)) from None
    shutil.rmtree(old, ignore_errors=True)


def clean_stale_staging(out: Path) -> None:
    """Remove the staging dirs (new_staging_dir) of earlier runs for the same OUT whose process is gone (kill -9)."""
    for d in out.parent.glob(f"{out.name}.tmp-*"):
        try:
            pid = int(d.name[len(out.name) + 5:].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, PermissionError, IndexError):
            continue


def exit_on_sigterm(signum, frame):
    """A SIGTERM handler: exit through the command's clean-up (its staging dir removed), as Ctrl-C does."""
    raise SystemExit(128 + signum)
