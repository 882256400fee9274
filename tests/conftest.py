"""Fixtures: tiny checkpoints converted and built into engines once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "model"))  # engines.py and the oracles package
from engines import build_engine  # noqa: E402


@pytest.fixture(scope="session")
def k3_tiny_ckpt(tmp_path_factory) -> Path:
    from k3build.config import preset
    from k3build.synth import synth

    out = tmp_path_factory.mktemp("k3tiny") / "ckpt"
    synth(out, preset("tiny"), seed=0)
    return out


@pytest.fixture(scope="session")
def k3_wide_experts_ckpt(tmp_path_factory) -> Path:
    """The tiny K3 with expert dims of 256 (latent width and intermediate): what the strided MoE layout needs."""
    import dataclasses

    from k3build.config import preset
    from k3build.synth import synth

    out = tmp_path_factory.mktemp("k3wide") / "ckpt"
    synth(out, dataclasses.replace(preset("tiny"), routed_expert_hidden_size=256, moe_intermediate_size=256), seed=0)
    return out


@pytest.fixture(scope="session")
def k3_tiny_engine(k3_tiny_ckpt, tmp_path_factory) -> Path:
    return build_engine(k3_tiny_ckpt, tmp_path_factory.mktemp("k3tiny_engine") / "engine")


@pytest.fixture
def mha_prefill_calls(monkeypatch) -> list[int]:
    """The query rows of each sequence the MLA's un-absorbed prefill attends (k3plugins.mla.prefill: mha_prefill's
    calls, and each sequence of mha_prefill_varlen's), which still runs: the list fills as the mixers call them."""
    prefill = pytest.importorskip("k3plugins.mla.prefill")
    calls, run, run_varlen = [], prefill.mha_prefill, prefill.mha_prefill_varlen
    monkeypatch.setattr(prefill, "mha_prefill", lambda q, *a, **k: (calls.append(q.shape[0]), run(q, *a, **k))[1])

    def varlen(q, kv_cache, page_table, group, *a, **k):
        calls.extend(end - start for _, start, end, _ in group)
        return run_varlen(q, kv_cache, page_table, group, *a, **k)

    monkeypatch.setattr(prefill, "mha_prefill_varlen", varlen)
    return calls


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist (`-n 2 --dist loadgroup`, tools/test.sh): one group a module, so that a module's
    fixtures (a tritonserver, the interpreter's children) start once, and one group for all of tests/dist, so that
    the multi-rank jobs (two to four ranks each, on two cores) run one at a time while the other worker runs the
    rest."""
    for item in items:
        group = "multirank" if item.path.parent.name == "dist" else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
