"""Which engines' decode steps may replay CUDA graphs (rank_runner.graph_blocker): the ranks that meet in a
captured collective must all replay the same step: every mapping qualifies on CUDA (pipeline stages keep their
hand-offs outside the graphs, tests/runtime/test_pp_graphs_gpu.py; attention-DP ranks replay the bucket the driver
picks for all of them, shared_bucket)."""

from types import SimpleNamespace

import pytest
from k3build.build.tactics import resolve_plugins
from k3build.mapping import Mapping
from k3runtime.rank_runner import Step, graph_blocker, shared_bucket, wait_for
from k3runtime.scheduler import ScheduledItem


def _engine(mapping: Mapping, target: str | None = None):
    """What graph_blocker reads of a RankEngine: its config's mapping (as the builder writes it), world size, and
    plugin table (the builder's for `target`; None: no plugin that syncs)."""
    plugins = resolve_plugins(target)[0] if target else {}
    return SimpleNamespace(config={"mapping": mapping.to_dict()}, world_size=mapping.world_size,
                           build={"plugins": plugins})


@pytest.mark.parametrize("mapping", [Mapping(), Mapping(tp_size=4), Mapping(tp_size=2, moe_ep_size=2),
                                     Mapping(tp_size=16, moe_ep_size=16), Mapping(tp_size=2, pp_size=2),
                                     Mapping(tp_size=8, moe_ep_size=8, pp_size=2), Mapping(tp_size=2, attention_dp=True),
                                     Mapping(tp_size=8, moe_ep_size=8, attention_dp=True)], ids=str)
def test_every_rank_runs_every_step_so_graphs_are_allowed(mapping):
    assert graph_blocker(_engine(mapping)) is None


def _item(tokens: int = 1, sample: bool = True) -> ScheduledItem:
    return ScheduledItem(request_id="r", token_ids=(1,) * tokens, start_pos=4, num_tokens=tokens, sample=sample,
                         slot_id=0, page_ids=(0,), params=None, seed=0, sample_index=0)


def _decode(n: int) -> Step:
    return Step(tuple(_item() for _ in range(n)))


IDLE = Step((_item(sample=False),), idle=True)  # llm_engine.dummy_step's shape: one throw-away token


@pytest.mark.parametrize("steps, bucket", [
    ((_decode(3), _decode(1)), 4),                  # the smallest bucket that holds the largest DP rank's batch
    ((_decode(5), IDLE), 8),                        # an idle rank replays the others' bucket, padding rows only
    ((IDLE, _decode(16)), 16),
    ((_decode(2), Step((_item(tokens=7),))), None),  # one rank prefills: every rank runs eagerly
    ((_decode(2), Step((_item(),), all_logits=True)), None),
    ((_decode(17), _decode(1)), None),              # past the largest bucket
    ((IDLE, IDLE), None),                           # nothing to decode
], ids=["3+1", "5+idle", "idle+16", "prefill", "score", "too-large", "all-idle"])
def test_attention_dp_ranks_share_one_bucket_or_none(steps, bucket):
    """The driver's choice for all attention-DP ranks (they meet in every expert exchange, so they must replay the
    same captured bucket or all run eagerly)."""
    assert shared_bucket(steps, [1, 2, 4, 8, 16]) == bucket


def test_multi_rank_graphs_stay_off_on_rocm(monkeypatch):
    import torch
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "RCCL" in graph_blocker(_engine(Mapping(tp_size=4)))
    assert graph_blocker(_engine(Mapping())) is None  # one rank: no collective in its graphs


def test_a_reference_that_syncs_keeps_graphs_off():
    """KDA's and MLA's torch references read lengths and slots on the host (.tolist()), which no CUDA graph can
    hold: an engine that runs one on a GPU (KDA on gfx942; an sm90 build made without fla-core) decodes eagerly
    instead of failing at capture."""
    why = graph_blocker(_engine(Mapping(), "gfx942"))
    assert why is not None and why.startswith("KDA: the torch reference reads device values on the host"), why
    eng = _engine(Mapping(), "gfx942")
    eng.build["plugins"]["MLA"] = {"version": 2, "tactic": "reference"}
    assert graph_blocker(eng).startswith("KDA, MLA:")
    eng.build["plugins"].update(KDA={"version": 2, "tactic": "fla"}, MLA={"version": 2, "tactic": "triton"})
    assert graph_blocker(eng) is None


def test_rank_zero_waits_for_a_replay_with_the_collective_timeout():
    """A replayed step's collectives are outside torch's NCCL watchdog: rank 0 polls the step's completion
    (wait_for) and fails like a timed-out collective, so launch.run can name the silent rank."""
    wait_for(lambda: True, 0.0, "a step")  # done at once: no wait, no error
    calls = []
    with pytest.raises(TimeoutError) as err:
        wait_for(lambda: calls.append(1) and False, 0.05, "a replayed decode step")
    assert len(calls) > 1 and "a replayed decode step timed out after 0 s (K3_DIST_TIMEOUT_S)" in str(err.value)
    assert "timed out" in str(err.value).lower()  # what heartbeat.explain_timeout looks for
