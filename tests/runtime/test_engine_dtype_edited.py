"""An engine whose config.json build_config.dtype no longer says the dtype it was built in: refused at load, naming
the rank's graph, the tensor and both dtypes. It loaded before and ran with the KDA conv cache (and, past the first
pipeline stage, the stage buffers) in the edited dtype: other logits without a word."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from engines import build_engine
from k3build.mapping import Mapping
from k3runtime.cli import main as runtime_main
from k3runtime.loader import EngineError, load_rank

SAYS = "but config.json's build_config.dtype, the dtype the runtime runs the model in, is {}: one of the two was " \
       "edited after the build; rebuild the engine"


def _set_dtype(engine: Path, dtype: str) -> None:
    cfg = json.loads((engine / "config.json").read_text())
    cfg["build_config"]["dtype"] = dtype
    (engine / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fp32_engine_said_to_be_16_bit(k3_tiny_engine, tmp_path, dtype):
    engine = Path(shutil.copytree(k3_tiny_engine, tmp_path / "engine"))
    _set_dtype(engine, dtype)
    with pytest.raises(EngineError) as e:
        load_rank(engine, 0, "cpu")
    assert str(e.value).startswith(f"{engine}/rank0/graph.onnx: weight 'embed' is fp32 (FLOAT), {SAYS.format(dtype)}")
    res = CliRunner().invoke(runtime_main, ["generate", str(engine), "--prompt", "hi", "--max-tokens", "1"])
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert "weight 'embed' is fp32 (FLOAT)" in res.output, res.output


def test_bf16_pipeline_said_to_be_fp32(k3_tiny_ckpt, tmp_path):
    """The first stage is told by its embedding, a later one by the hidden state it receives (it has no embedding)."""
    engine = build_engine(k3_tiny_ckpt, tmp_path / "engine", mapping=Mapping(pp_size=2), dtype="bf16",
                          kv_dtype="bf16")
    load_rank(engine, 1, "cpu")
    _set_dtype(engine, "fp32")
    for rank, what in ((0, "weight 'embed'"), (1, "stage input 'hidden_in'")):
        with pytest.raises(EngineError) as e:
            load_rank(engine, rank, "cpu")
        assert str(e.value).startswith(f"{engine}/rank{rank}/graph.onnx: {what} is bf16 (BFLOAT16), "
                                       f"{SAYS.format('fp32')}"), str(e.value)
