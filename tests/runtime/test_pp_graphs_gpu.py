"""A two-stage engine's decode steps replayed from CUDA graphs (pytest -m gpu): each stage replays its own graph a
micro-batch, and the hand-off of the hidden state and the snapshots between stages stays outside the graphs
(RankRunner._replay).

Both stages run on one GPU, as two RankRunners of one process: NCCL refuses two ranks on one device, so an
in-process queue carries the hand-offs in place of NCCL's send and receive (the stages' graphs, caches and kernels
are the real ones). A replayed step must give the logits and leave the caches of the same runners' eager step,
and the two stages together the logits of the one-stage engine."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engines import build_engine  # noqa: E402
from k3build.mapping import Mapping  # noqa: E402
from k3runtime.executor import Communicator  # noqa: E402
from k3runtime.loader import load_rank  # noqa: E402
from k3runtime.rank_runner import RankRunner, Step  # noqa: E402
from k3runtime.scheduler import ScheduledItem  # noqa: E402

PAGES, SLOTS = 8, 4
ROWS = [(5, 0, 1, [0]), (6, 1, 9, [1]), (7, 2, 70, [2, 3]), (8, 3, 3, [4])]  # (token, slot, context, pages)


class QueuePipe(Communicator):
    """Stage s's sends become stage s+1's receives, in order (copies, as a transport makes)."""

    def __init__(self, queue: deque):
        self.queue = queue

    def send_stage(self, hidden, blocks):
        self.queue.append([t.clone() for t in (hidden, *blocks)])

    def recv_stage(self, num_tokens, hidden_size, num_blocks, dtype):
        hidden, *blocks = self.queue.popleft()
        assert hidden.shape == (num_tokens, hidden_size) and hidden.dtype == dtype and len(blocks) == num_blocks
        return {"hidden_in": hidden, **{f"blocks_in.{i}": b for i, b in enumerate(blocks)}}


def _step(micro_batches: int = 2) -> Step:
    """The four rows' decode step, cut in two micro-batches by default (the engine's estimate would keep it whole:
    micro_batch.py)."""
    return Step(tuple(ScheduledItem(request_id=str(i), token_ids=(tok,), start_pos=ctx - 1, num_tokens=1, sample=True,
                                    slot_id=slot, page_ids=tuple(pages), params=None, seed=0, sample_index=0)
                      for i, (tok, slot, ctx, pages) in enumerate(ROWS)), micro_batches=micro_batches)


def _runners(engine_dir, world: int, cuda_graphs: bool) -> list[RankRunner]:
    pipe = QueuePipe(deque())
    runners = []
    for rank in range(world):
        engine = load_rank(engine_dir, rank, "cuda")
        runners.append(RankRunner(engine, engine.cache_config(num_pages=PAGES + 1, num_slots=SLOTS + 1), pipe,
                                  spare=(PAGES, SLOTS), cuda_graphs=cuda_graphs))
    return runners


def _caches(runner):
    c = runner.cache
    return c.kda_state_all, c.kda_conv_all, c.mla_kv_all


def _run(runners, step):
    out = [r.run(step) for r in runners]  # stage 0 sends every micro-batch, then stage 1 takes them in turn
    return out[-1]


@pytest.mark.parametrize("cuts", [1, 2])
def test_two_stages_replay_their_graphs_as_their_eager_steps(k3_tiny_ckpt, tmp_path, cuts):
    """cuts: the step whole (one replay a stage, its logits not copied) or in two micro-batches."""
    pp2 = build_engine(k3_tiny_ckpt, tmp_path / "pp2", mapping=Mapping(pp_size=2), target="sm90", dtype="bf16",
                       kv_dtype="bf16")
    stages = _runners(pp2, 2, cuda_graphs=True)
    assert all(r.graphs_off is None and r.graphs is not None for r in stages)
    assert set(stages[1].graphs.stage_in) == {"hidden_in"} | {f"blocks_in.{i}" for i in range(stages[1].num_blocks_in)}
    replays = []
    for r in stages:
        run = r.graphs.run
        r.graphs.run = lambda rows, *a, _run=run, **kw: replays.append(len(rows)) or _run(rows, *a, **kw)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for r in stages:
        for t in _caches(r):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda") * 0.1)
    saved = [[t.clone() for t in _caches(r)] for r in stages]
    step = _step(cuts)
    replayed = _run(stages, step).clone()
    assert replays == [4 // cuts] * 2 * cuts  # the micro-batches' rows, on each stage
    after_replay = [[t.clone() for t in _caches(r)] for r in stages]

    for r, s in zip(stages, saved):
        for t, v in zip(_caches(r), s):
            t.copy_(v)
        r.graphs, r.saved_graphs = None, r.graphs  # the same runners, eagerly
    eager = _run(stages, step)
    assert torch.isfinite(replayed).all()
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    for r, after in zip(stages, after_replay):
        for t, v in zip(_caches(r), after):
            torch.testing.assert_close(t, v, rtol=1e-5, atol=1e-5)

    # the two stages together compute the one-stage engine's logits (fresh, zeroed caches on both sides)
    one = _runners(build_engine(k3_tiny_ckpt, tmp_path / "pp1", target="sm90", dtype="bf16", kv_dtype="bf16"), 1,
                   cuda_graphs=True)
    for r in stages:
        r.graphs = r.saved_graphs
        for t in _caches(r):
            t.zero_()
    whole = _run(one, replace(step, micro_batches=1))
    staged = _run(stages, step)
    # micro-batches of two rows against one batch of four: kernels may take other blocks, so bf16 sums may differ
    assert ((staged - whole).norm() / whole.norm()).item() < 1e-2


def test_two_stages_replay_fed_tokens_in_every_micro_batch(k3_tiny_ckpt, tmp_path):
    """Async scheduling with pipeline stages: a replayed step whose inputs are the previous step's sampled ids, fed
    on the device, in both micro-batches (item 3 sits in the second), gives the logits and caches of the eager step
    given those ids as tokens."""
    from k3runtime.request import PLACEHOLDER

    pp2 = build_engine(k3_tiny_ckpt, tmp_path / "pp2", mapping=Mapping(pp_size=2), target="sm90", dtype="bf16",
                       kv_dtype="bf16")
    stages = _runners(pp2, 2, cuda_graphs=True)
    plain = _step()
    fed = torch.tensor([6, 11, 8], dtype=torch.int64, device="cuda")  # what the previous step sampled
    items = list(plain.items)
    for i in (1, 3):
        items[i] = replace(items[i], token_ids=(PLACEHOLDER,))
    feeding = replace(plain, items=tuple(items), feed=((1, 0), (3, 2)))
    given = replace(plain, items=tuple(replace(it, token_ids=(t,)) for it, t in zip(plain.items, (5, 6, 7, 8))))
    saved = [[t.clone() for t in _caches(r)] for r in stages]
    replayed = [r.run(feeding, fed) for r in stages][-1].clone()
    after = [[t.clone() for t in _caches(r)] for r in stages]
    for r, s in zip(stages, saved):
        for t, v in zip(_caches(r), s):
            t.copy_(v)
        r.graphs = None
    eager = _run(stages, given)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    for r, a in zip(stages, after):
        for t, v in zip(_caches(r), a):
            torch.testing.assert_close(t, v, rtol=1e-5, atol=1e-5)
