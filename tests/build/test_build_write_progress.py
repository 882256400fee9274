"""A rank's weights are written twice: tensors into a side file under the per-layer bar, then header + all the
data into weights.safetensors (SafetensorsWriter.close). The second pass is as long as the first (4 GiB on this
machine: 23 s under the bar, 31 s after it) and ran with no progress shown, after the bar said 100 %."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from k3build.build.st_writer import SafetensorsWriter
from k3build.cli import main
from k3build.convert import convert
from k3build.mapping import Mapping


def test_close_reports_every_byte(tmp_path):
    w = SafetensorsWriter(tmp_path / "w.safetensors")
    for i in range(5):
        w.add(f"t{i}", torch.arange(3 << 20, dtype=torch.int32))  # 12 MiB each: several 16 MiB copy chunks
    seen = []
    w.close(progress=seen.append)
    assert sum(seen) == w.data_bytes == 5 * (12 << 20) and len(seen) > 1


def test_build_shows_the_write_pass_per_rank(k3_tiny_ckpt, tmp_path):
    conv = convert(k3_tiny_ckpt, tmp_path / "conv", Mapping(tp_size=2), progress=False)
    res = CliRunner().invoke(main, ["build", str(conv), str(tmp_path / "engine"), "--max-seq-len", "256",
                                    "--max-num-tokens", "256"])
    assert res.exit_code == 0, res.output
    for r in (0, 1):
        assert f"write rank{r}" in res.stderr, res.stderr
        # the bar counts the data bytes (the file less its header) and finishes
        line = [x for x in res.stderr.replace("\r", "\n").splitlines() if x.startswith(f"write rank{r}: 100%")]
        assert line, res.stderr
    assert "write rank" not in CliRunner().invoke(main, ["build", str(conv), str(tmp_path / "e2"), "--max-seq-len",
                                                         "256", "--max-num-tokens", "256", "--no-progress"]).output
