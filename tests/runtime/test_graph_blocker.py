"""Which engines' decode steps may replay CUDA graphs (rank_runner.graph_blocker): the ranks that meet in a
captured collective must all replay the same step, so only mappings where every rank runs every step qualify."""

from types import SimpleNamespace

import pytest
from k3build.mapping import Mapping
from k3runtime.rank_runner import graph_blocker


def _engine(mapping: Mapping):
    """What graph_blocker reads of a RankEngine: its config's mapping (as the builder writes it) and world size."""
    return SimpleNamespace(config={"mapping": mapping.to_dict()}, world_size=mapping.world_size)


@pytest.mark.parametrize("mapping", [Mapping(), Mapping(tp_size=4), Mapping(tp_size=2, moe_ep_size=2),
                                     Mapping(tp_size=16, moe_ep_size=16)], ids=str)
def test_every_rank_runs_every_step_so_graphs_are_allowed(mapping):
    assert graph_blocker(_engine(mapping)) is None


@pytest.mark.parametrize("mapping, why", [(Mapping(tp_size=2, pp_size=2), "pp_size 2"),
                                          (Mapping(tp_size=2, attention_dp=True), "attention-DP")], ids=str)
def test_stages_or_attention_dp_run_eagerly_and_say_why(mapping, why):
    assert why in graph_blocker(_engine(mapping))
