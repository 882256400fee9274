"""Fixtures of the multi-rank tests: the tiny K3 cut to six layers.

Four gloo ranks on this suite's two cores spend most of a step in all-reduce hand-offs (about 7 ms each, three a
layer), so the multi-rank jobs run a shorter model. It keeps every feature a mapping splits: the dense layer 0,
KDA and MLA layers on both pipeline stages (3 + 3), AttnRes blocks of two, so the stage boundary cuts one, and
the latent MoE on every later layer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from engines import build_engine

LAYER_TYPES = ("kda", "mla", "kda", "kda", "mla", "mla")


@pytest.fixture(scope="session")
def k3_short_ckpt(tmp_path_factory) -> Path:
    from k3build.config import preset
    from k3build.synth import synth

    config = dataclasses.replace(preset("tiny"), num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
                                 attn_res_block_size=2)
    out = tmp_path_factory.mktemp("k3short") / "ckpt"
    synth(out, config, seed=0)
    return out


@pytest.fixture(scope="session")
def k3_short_engine(k3_short_ckpt, tmp_path_factory) -> Path:
    return build_engine(k3_short_ckpt, tmp_path_factory.mktemp("k3short_engine") / "engine")
