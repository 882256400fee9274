"""Which engines' decode steps may replay CUDA graphs (rank_runner.graph_blocker): the ranks that meet in a
captured collective must all replay the same step, so only mappings where every rank runs every step qualify
(pipeline stages do: the hand-offs between them stay outside the graphs, tests/runtime/test_pp_graphs_gpu.py)."""

from types import SimpleNamespace

import pytest
from k3build.mapping import Mapping
from k3runtime.rank_runner import graph_blocker, wait_for


def _engine(mapping: Mapping):
    """What graph_blocker reads of a RankEngine: its config's mapping (as the builder writes it) and world size."""
    return SimpleNamespace(config={"mapping": mapping.to_dict()}, world_size=mapping.world_size)


@pytest.mark.parametrize("mapping", [Mapping(), Mapping(tp_size=4), Mapping(tp_size=2, moe_ep_size=2),
                                     Mapping(tp_size=16, moe_ep_size=16), Mapping(tp_size=2, pp_size=2),
                                     Mapping(tp_size=8, moe_ep_size=8, pp_size=2)], ids=str)
def test_every_rank_runs_every_step_so_graphs_are_allowed(mapping):
    assert graph_blocker(_engine(mapping)) is None


@pytest.mark.parametrize("mapping", [Mapping(tp_size=2, attention_dp=True),
                                     Mapping(tp_size=2, pp_size=2, attention_dp=True)], ids=str)
def test_attention_dp_runs_eagerly_and_says_why(mapping):
    assert "attention-DP" in graph_blocker(_engine(mapping))


def test_multi_rank_graphs_stay_off_on_rocm(monkeypatch):
    import torch
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "RCCL" in graph_blocker(_engine(Mapping(tp_size=4)))
    assert graph_blocker(_engine(Mapping())) is None  # one rank: no collective in its graphs


def test_rank_zero_waits_for_a_replay_with_the_collective_timeout():
    """A replayed step's collectives are outside torch's NCCL watchdog: rank 0 polls the step's completion
    (wait_for) and fails like a timed-out collective, so launch.run can name the silent rank."""
    wait_for(lambda: True, 0.0, "a step")  # done at once: no wait, no error
    calls = []
    with pytest.raises(TimeoutError) as err:
        wait_for(lambda: calls.append(1) and False, 0.05, "a replayed decode step")
    assert len(calls) > 1 and "a replayed decode step timed out after 0 s (K3_DIST_TIMEOUT_S)" in str(err.value)
    assert "timed out" in str(err.value).lower()  # what heartbeat.explain_timeout looks for
