"""--swap-space-gib: the host store of swap preemption sized in bytes (engine_options.host_sizes) instead of
pages and slots, held on every rank of a pipeline whose stages cache different layers."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from k3build.mapping import Mapping
from k3runtime.engine_options import EngineOptions, check_build_limits, host_sizes
from k3runtime.kv_cache.cache_tensors import CacheConfig
from k3runtime.loader import EngineError, load_rank
from k3runtime.model_facts import KDA, MLA

from engines import build_engine

GiB = 2**30


@pytest.fixture(scope="module")
def pp2_engine(k3_tiny_ckpt, tmp_path_factory):
    return build_engine(k3_tiny_ckpt, tmp_path_factory.mktemp("swap_space") / "engine", mapping=Mapping(pp_size=2))


def test_the_budget_holds_on_every_stage(pp2_engine):
    """Each rank's cache bytes, read from config.json alone, are those of its loaded layers; the host store's
    counts fit the budget on both stages (whose bytes a page and a slot differ), filled on the costlier one, in the
    device cache's mix of pages to slots."""
    config = json.loads((pp2_engine / "config.json").read_text())
    pages, slots = config["memory_plan"]["num_pages"], config["memory_plan"]["num_slots"]
    ranks = []
    for rank in range(2):
        engine = load_rank(pp2_engine, rank, "cpu")
        c = CacheConfig.for_rank(config, rank, num_pages=pages, num_slots=slots)
        assert (c.num_mla_layers, c.num_kda_layers) == (len(engine.local_layers(MLA)), len(engine.local_layers(KDA)))
        ranks.append(c)
    assert (ranks[0].bytes_per_page, ranks[0].bytes_per_slot) != (ranks[1].bytes_per_page, ranks[1].bytes_per_slot)
    worst = max(ranks, key=lambda c: c.nbytes)
    for gib in (0.01, 0.25):
        budget = int(gib * GiB)
        host_pages, host_slots = host_sizes(config, EngineOptions(preemption_mode="swap", swap_space_gib=gib))
        for c in ranks:
            assert host_pages * c.bytes_per_page + host_slots * c.bytes_per_slot <= budget
        # filled: one more device cache's mix in pages and slots would not fit on the costlier rank
        assert (host_pages + pages / slots) * worst.bytes_per_page + (host_slots + 1) * worst.bytes_per_slot > budget
        assert abs(host_pages / host_slots - pages / slots) < pages / slots * 0.05


def test_a_budget_without_a_slot_is_refused_before_loading(pp2_engine):
    config = json.loads((pp2_engine / "config.json").read_text())
    options = EngineOptions(preemption_mode="swap", swap_space_gib=1e-5)
    with pytest.raises(EngineError, match=r"swap_space_gib 1e-05 holds \d+ host pages and 0 KDA slots \(rank \d: "
                                          r".* give at least 0\.\d+ GiB") as e:
        check_build_limits(options, config, pp2_engine)
    least = float(str(e.value).rsplit("at least ", 1)[1].split()[0])
    host_sizes(config, EngineOptions(preemption_mode="swap", swap_space_gib=least))  # what it names is enough
    assert str(e.value).startswith(f"{pp2_engine}: ")


@pytest.mark.parametrize("kwargs, says", [
    (dict(preemption_mode="swap", swap_space_gib=0), "swap_space_gib: expected None or a number of GiB > 0, got 0"),
    (dict(preemption_mode="swap", swap_space_gib=float("nan")), "a number of GiB > 0, got nan"),
    (dict(preemption_mode="swap", swap_space_gib=True), "a number of GiB > 0, got True"),
    (dict(swap_space_gib=1.0), "swap_space_gib (1.0) holds swapped requests: it needs preemption_mode 'swap'"),
    (dict(preemption_mode="swap", swap_space_gib=1.0, num_host_pages=4, num_host_slots=1),
     "swap_space_gib (1.0) sizes the host store itself: give it or num_host_pages and num_host_slots (4 / 1)"),
])
def test_bad_swap_space_options(kwargs, says):
    with pytest.raises(ValueError) as e:
        EngineOptions(**kwargs)
    assert says in str(e.value)


def test_generate_takes_swap_space_gib(k3_tiny_engine, monkeypatch):
    """The flag reaches the engine: the scheduler's host pools and the rank's host store have the counts it holds
    (tests/model/test_invariance.py swaps requests out to such a store and back)."""
    from k3runtime import api, llm_engine
    from k3runtime.cli import main

    args = ["generate", str(k3_tiny_engine), "--prompt", "Hello there", "--prompt", "Hi", "--max-tokens", "9"]
    made = []
    monkeypatch.setattr(api, "LLMEngine",
                        lambda path, options: made.append(llm_engine.LLMEngine(path, options)) or made[-1])
    plain = CliRunner().invoke(main, args)
    small = CliRunner().invoke(main, [*args, "--num-pages", "2", "--preemption-mode", "swap", "--swap-space-gib",
                                      "0.01"])
    assert plain.exit_code == small.exit_code == 0, small.output
    assert small.stdout == plain.stdout  # the completions (stderr: the load's progress, its rates)
    engine = made[-1]
    config = json.loads((k3_tiny_engine / "config.json").read_text())
    want = host_sizes(config, EngineOptions(num_pages=2, preemption_mode="swap", swap_space_gib=0.01))
    store = engine.runner.host_store
    assert (engine.scheduler.host_page_pool.num_pages, engine.scheduler.host_slot_pool.num_slots) == want
    assert (store.num_pages, store.num_slots) == want and want[0] > 0 and want[1] > 0
    bad = CliRunner().invoke(main, [*args, "--swap-space-gib", "0"])
    assert bad.exit_code != 0 and "--swap-space-gib" in bad.output
    bad = CliRunner().invoke(main, [*args, "--preemption-mode", "swap", "--swap-space-gib", "1e-7"])
    assert bad.exit_code != 0 and "--swap-space-gib 1e-07 holds" in bad.output, bad.output


@pytest.mark.parametrize("mapping, share", [(Mapping(tp_size=2), 2), (Mapping(tp_size=2, attention_dp=True), 1)],
                         ids=["tp2", "tp2-attention-dp"])
def test_each_rank_holds_its_share_of_the_kda_heads(k3_tiny_ckpt, tmp_path, mapping, share):
    """Under tensor parallelism a rank's KDA slots hold its share of the heads; attention-DP ranks hold them all:
    the bytes a slot that the budget is split by are the ones the rank allocates (its CacheTensors)."""
    from k3runtime.kv_cache import CacheTensors

    engine_dir = build_engine(k3_tiny_ckpt, tmp_path / "engine", mapping=mapping)
    config = json.loads((engine_dir / "config.json").read_text())
    for rank in range(2):
        c = CacheConfig.for_rank(config, rank, num_pages=2, num_slots=3)
        assert c.kda_num_heads * share == config["pretrained_config"]["kda_num_heads"]
        cache = CacheTensors(c, torch.device("cpu"))
        held = sum(t.numel() * t.element_size() for t in (cache.kda_state_all, cache.kda_conv_all))
        assert held == 3 * c.bytes_per_slot
        assert cache.mla_kv_all.numel() * cache.mla_kv_all.element_size() == 2 * c.bytes_per_page
