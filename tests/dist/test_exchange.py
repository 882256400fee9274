"""Expert exchange backends on real gloo ranks: NCCL-style (all-gather / reduce-scatter) and the DeepEP adapter
(with tests/dist/deep_ep_standin in place of DeepEP) give each token the same sum over every rank's experts as
running all the experts on one rank; the backend choice at start-up and its errors."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from liveness import free_port

from k3plugins.moe.reference import moe_experts
from k3plugins.ep import DeepEPExchange, NcclExchange
from k3runtime.dist.exchange import choose_backend
from k3runtime.loader import EngineError

STANDIN = str(Path(__file__).with_name("deep_ep_standin"))
E, K, D, I, C = 8, 3, 32, 16, 6  # experts, top-k, width, expert inner dim, tokens per rank at most
TOKENS = [5, 2]  # ragged: rank 1 has fewer tokens than rank 0


def _problem():
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5, torch.randn(E, D, I, generator=g) / I ** 0.5
    per_rank = []
    for t in TOKENS:
        z = torch.randn(t, D, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        per_rank.append((z, ids, torch.rand(t, K, generator=g)))
    return w13, w2, per_rank


def _rank(rank: int, port: int, backend: str, out: str):
    sys.path.insert(0, STANDIN)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    w13, w2, per_rank = _problem()
    z, ids, w = per_rank[rank]
    local = slice(rank * E // 2, (rank + 1) * E // 2)
    group = dist.new_group([0, 1])
    if backend == "nccl":
        ex = NcclExchange(group, upcast=True)
    else:
        ex = DeepEPExchange(group, num_experts=E, expert_start=local.start, hidden=D, capacity=C)
    zs, ids_s, w_s = ex.dispatch(z, ids, w, C)
    y = moe_experts(zs, ids_s, w_s, w13[local], None, w2[local], None, expert_start=local.start, act="silu")
    torch.save(ex.combine(y, z.shape[0], C), f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["nccl", "deepep"])
def test_exchange_equals_all_experts_on_one_rank(backend, tmp_path):
    mp.spawn(_rank, args=(free_port(), backend, str(tmp_path / "y")), nprocs=2)
    w13, w2, per_rank = _problem()
    for rank, (z, ids, w) in enumerate(per_rank):
        want = moe_experts(z, ids, w, w13, None, w2, None, expert_start=0, act="silu")
        got = torch.load(tmp_path / f"y.{rank}")
        assert got.shape == want.shape
        # the DeepEP adapter hands back bf16 expert rows (DeepEP's combine takes bf16): one rounding each
        tol = 1e-5 if backend == "nccl" else 5e-3
        assert ((got.float() - want).norm() / want.norm()).item() < tol


def _config(k3_short_engine, **changes) -> dict:
    cfg = json.loads((k3_short_engine / "config.json").read_text())
    for key, value in changes.items():
        section, field = key.split("__")
        cfg[section][field] = value
    return cfg


def test_backend_chosen_at_startup(k3_short_engine, tmp_path, monkeypatch):
    assert choose_backend(_config(k3_short_engine)) == "nccl"  # what the build records by default
    assert choose_backend(_config(k3_short_engine, build_config__expert_backend="local")) == "local"
    with pytest.raises(EngineError, match="'local' cannot serve an engine with moe_ep_size=2"):
        choose_backend(_config(k3_short_engine, build_config__expert_backend="local", mapping__moe_ep_size=2))
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps({"max_topk": 64, "hidden_sizes": list(range(16, 8193, 16))}))
    monkeypatch.setenv("K3_DEEPEP_CAPS", str(caps))
    assert choose_backend(_config(k3_short_engine, build_config__dtype="bf16"), enable_deepep=True) == "deepep"
    with pytest.raises(EngineError, match="carries bf16 tokens; this engine's activations are fp32"):
        choose_backend(_config(k3_short_engine), enable_deepep=True)
    with pytest.raises(EngineError, match="expert_backend is 'mpi'"):
        choose_backend(_config(k3_short_engine, build_config__expert_backend="mpi"))


def test_exchange_is_counted_in_the_heartbeat(tmp_path):
    """The communicator's expert dispatch and combine each count as a collective of the moe group in the rank's
    beat (heartbeat.collective), as its all-reduces do: a rank that never reaches an exchange its group entered is
    named by stuck_ranks. A one-rank gloo group, the NCCL-style backend."""
    from k3runtime.dist import heartbeat
    from k3runtime.dist.comm import DistCommunicator

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        comm = DistCommunicator({"0": {"tp_group": [0], "moe_group": [0]}}, 0, 1, torch.device("cpu"))
        comm.use_exchange(NcclExchange(comm.groups["moe"], upcast=True))
        key = comm.group_keys["moe"]
        before = heartbeat._state()["n"].get(key, 0)
        z, ids, w = torch.randn(3, D), torch.zeros(3, K, dtype=torch.int64), torch.rand(3, K)
        zs, _, _ = comm.ep_gather(z, ids, w, group="moe", capacity=C)
        y = comm.ep_scatter(zs, z, group="moe", capacity=C)
        state = heartbeat._state()
        assert state["n"][key] == before + 2 and state["in"] is None
        assert torch.equal(y, z)  # one rank: its own rows back
    finally:
        dist.destroy_process_group()
