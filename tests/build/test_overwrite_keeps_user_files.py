"""--overwrite replaces k3build's own output whole, so it must not take a user's files kept in it, nor an output
written inside the command's own input (replacing that input later would take it): both refused up front, naming
what is in the way, with nothing changed."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from k3build.cli import main

FAST = ["--dtype", "fp32", "--kv-dtype", "fp32", "--max-seq-len", "256", "--max-num-tokens", "256", "--no-progress"]


def _run(*args) -> tuple[int, str]:
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_overwrite_names_the_users_files_and_keeps_them(tmp_path):
    ckpt, conv, engine = tmp_path / "ckpt", tmp_path / "conv", tmp_path / "engine"
    assert _run("synth", ckpt, "--preset", "tiny")[0] == 0
    assert _run("convert", ckpt, conv)[0] == 0
    assert _run("build", conv, engine, *FAST)[0] == 0
    # k3build's own outputs are replaced as before (empty rank dirs of an old build are its own too)
    (engine / "rank7").mkdir()
    for cmd in (("synth", ckpt, "--preset", "tiny"), ("convert", ckpt, conv), ("build", conv, engine, *FAST)):
        code, out = _run(*cmd, "--overwrite")
        assert code == 0, (cmd, out)
    assert not (engine / "rank7").exists()
    # a user's notes and results kept in each: refused, named, untouched
    for out_dir, cmd in ((ckpt, ("synth", ckpt, "--preset", "tiny")), (conv, ("convert", ckpt, conv)),
                         (engine, ("build", conv, engine, *FAST))):
        (out_dir / "MY_NOTES.txt").write_text("mine")
        (out_dir / "bench_results").mkdir()
        before = _tree(out_dir)
        code, out = _run(*cmd, "--overwrite")
        assert code != 0 and "holds MY_NOTES.txt, bench_results/, which k3build did not write" in out, (cmd, out)
        assert "move it out first" in out and _tree(out_dir) == before
    (engine / "MY_NOTES.txt").unlink()
    (engine / "bench_results").rmdir()
    (engine / "rank0" / "profile.nsys-rep").write_text("mine")  # inside a rank dir too
    code, out = _run("build", conv, engine, *FAST, "--overwrite")
    assert code != 0 and "holds rank0/, which k3build did not write" in out, out


def test_output_inside_the_input_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert _run("synth", ckpt, "--preset", "tiny")[0] == 0
    before = _tree(ckpt)
    code, out = _run("convert", ckpt, ckpt / "conv")
    assert code != 0 and f"{ckpt / 'conv'}: inside the input {ckpt}" in out, out
    assert _run("convert", ckpt, tmp_path / "conv")[0] == 0
    code, out = _run("build", tmp_path / "conv", tmp_path / "conv" / "engine", *FAST)
    assert code != 0 and "inside the input" in out, out
    assert _tree(ckpt) == before and not (tmp_path / "conv" / "engine").exists()
