"""A rank attached to a host weight store gets the same checks of its weights file as a read from disk: the store
copies the file as it is, so another rank's or build's file, or a truncated one, must be refused by the same one
line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engines import build_engine
from test_weight_store import Store

from k3runtime.loader import EngineError, load_rank


@pytest.fixture(scope="module")
def tp2(k3_tiny_ckpt, tmp_path_factory) -> Path:
    from k3build.mapping import Mapping

    return build_engine(k3_tiny_ckpt, tmp_path_factory.mktemp("wsh") / "engine", mapping=Mapping(tp_size=2))


@pytest.fixture
def served(tp2, tmp_path, monkeypatch):
    """damage(fn) -> a copy of the TP2 engine damaged by fn, served by a store the loader is configured for."""
    started = []

    def serve(damage) -> Path:
        engine = Path(shutil.copytree(tp2, tmp_path / "engine"))
        damage(engine)
        # an engine from before the recorded digests: with them the store itself refuses a damaged file
        cfg = json.loads((engine / "config.json").read_text())
        for info in cfg["ranks"].values():
            info.pop("weights_sha256", None)
        (engine / "config.json").write_text(json.dumps(cfg))
        started.append(Store(engine))
        started[-1].wait_ready()
        cfg = tmp_path / "wsc.json"
        cfg.write_text(json.dumps(started[-1].config()))
        monkeypatch.setenv("K3_WEIGHT_STORE_CONFIG", str(cfg))
        return engine

    yield serve
    for s in started:
        s.close()


def _swap(engine: Path) -> None:
    a, b, t = (engine / f"{d}/weights.safetensors" for d in ("rank0", "rank1", "x"))
    (engine / "x").mkdir()
    a.rename(t), b.rename(a), t.rename(b)


def test_store_of_rank_files_swapped_between_ranks_is_refused(served):
    engine = served(_swap)
    with pytest.raises(EngineError, match=r"holds rank 1's weights, not rank 0's"):
        load_rank(engine, 0)


def test_store_of_a_truncated_rank_file_names_the_file_and_tensor(served):
    def truncate(engine):
        with open(engine / "rank0/weights.safetensors", "r+b") as f:
            f.truncate(f.seek(0, 2) - 1000)

    engine = served(truncate)
    with pytest.raises(EngineError, match=r"rank0/weights.safetensors: corrupt \(tensor '[^']+': .*truncated file\?"):
        load_rank(engine, 0)


def test_store_of_an_intact_engine_still_attaches(served, monkeypatch):
    import k3runtime.loader as loader

    engine = served(lambda e: None)
    # from the store's mapping: a read from disk would fail the test (rank.weights' keys are tensor names, so a
    # check of their text for "k3ws-" passed whichever way the rank loaded)
    monkeypatch.setattr(loader, "read_weights", lambda *a, **k: pytest.fail("read from disk, not attached"))
    rank = load_rank(engine, 1)
    assert rank.weights
