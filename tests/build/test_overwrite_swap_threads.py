"""A Ctrl-C or SIGTERM that comes while `--overwrite` swaps OUT, in a process with other threads (a real build has
tqdm's monitor and torch's OpenMP workers): blocking the signals in the swapping thread alone does not hold them,
since the kernel hands a process-directed signal to any thread that does not block it, and CPython then runs its
handler in the main thread at the next bytecode, between the two renames."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from k3build.output_dir import PID_FILE, move_into_place


def test_a_signal_during_the_swap_waits_for_it_with_other_threads(tmp_path, monkeypatch):
    out, staging = tmp_path / "engine", tmp_path / ".engine.tmp-abc"
    (out / "rank0").mkdir(parents=True)
    (out / "config.json").write_text("old")
    staging.mkdir()
    (staging / "config.json").write_text("new")
    (staging / PID_FILE).write_text("1 h -\n")
    done = threading.Event()
    other = threading.Thread(target=done.wait, daemon=True)  # any thread that does not block SIGINT
    other.start()
    replace, calls = os.replace, []

    def interrupted(src, dst):
        replace(src, dst)
        calls.append(dst)
        if len(calls) == 1:  # OUT is aside, the new one not yet in place: Ctrl-C now
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)

    monkeypatch.setattr(os, "replace", interrupted)
    try:
        move_into_place(staging, out, RuntimeError)
    except KeyboardInterrupt:
        left = sorted(p.name for p in tmp_path.iterdir())
        pytest.fail(f"interrupted between the renames: OUT exists {out.exists()}, beside it {left}")
    finally:
        done.set()
        other.join()
    assert (out / "config.json").read_text() == "new"
    # the held Ctrl-C lands after the swap: what is left of the old engine says whose it is (the next run's to remove)
    assert all((p / PID_FILE).is_file() for p in tmp_path.iterdir() if p.name.startswith(".engine.old-"))
    assert not staging.exists()
