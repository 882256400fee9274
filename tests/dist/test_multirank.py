"""Real multi-process ranks (torchrun + gloo): logits and tokens equal the single-rank engine's."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_job import logprob_asks, penalized
from engines import build_engine

from k3build.mapping import Mapping
from k3runtime import LLM, SamplingParams

JOB = Path(__file__).with_name("dist_job.py")
PROMPTS = [[1, 40, 97, 311, 5, 260, 18, 77, 402, 9, 133, 64, 250, 3, 88, 500, 12] * 4, [1, 7, 9],
           [1, 300, 301, 302, 303], [1] + list(range(100, 150))]
MAX_TOKENS = 12
# chunked prefill (chunk 16) and a page budget small enough to force preemption
OPTIONS = {"max_prefill_chunk": 16, "num_pages": 3}

# pipeline stages: pp2xtp2 cuts every step of more than one sequence in two (the feed offsets, the hand-offs and
# the logits of each micro-batch), pp2 takes the engine's choice (micro_batch.py), which keeps the tiny model's
# steps whole
CUT = {"pp2xtp2": {"pp_micro_batches": 2}}
MAPPINGS = {
    "tp2": Mapping(tp_size=2, moe_tp_size=2),
    "ep4": Mapping(tp_size=4),
    "tp2xep2": Mapping(tp_size=4, moe_tp_size=2),
    "pp2": Mapping(pp_size=2),
    "pp2xtp2": Mapping(tp_size=2, pp_size=2),
    "dp2xep2": Mapping(tp_size=2, attention_dp=True),
}


@pytest.fixture(scope="module")
def reference(k3_short_engine):
    llm = LLM(k3_short_engine, **OPTIONS)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], logprob_asks())
    return {"logits": llm.logits(PROMPTS[0]), "tokens": [o.token_ids for o in llm.generate(PROMPTS, greedy)],
            "logprobs": [o.logprobs for o in outs[:2]], "unasked": [None, outs[2].token_ids],
            "prompt_logprobs": [o.prompt_logprobs for o in outs[:2]],
            "penalized": [o.token_ids for o in llm.generate(PROMPTS[:2], penalized(MAX_TOKENS))]}


def assert_logprobs_and_penalties_match(got, reference):
    """dist_job's logprobs (two requests asking for 2 and 3 alternatives, and for their prompt's, beside one that
    does not ask) and its penalized requests' tokens equal one rank's."""
    assert got["penalized"] == reference["penalized"]
    assert got["unasked"] == reference["unasked"]
    for prompt, want, ids in zip(got["prompt_logprobs"], reference["prompt_logprobs"], PROMPTS):
        assert len(prompt) == len(want) == len(ids) and prompt[0] is want[0] is None
        assert [[t for t, _ in top] for _, top in prompt[1:]] == [[t for t, _ in w.top] for w in want[1:]]
        assert [v for v, _ in prompt[1:]] == pytest.approx([w.logprob for w in want[1:]], abs=1e-4)
    got, reference = got["logprobs"], reference["logprobs"]
    assert len(got) == len(reference) == 2
    for g, want in zip(got, reference):
        assert [[t for t, _ in top] for _, top in g] == [[t for t, _ in w.top] for w in want]
        assert [v for v, _ in g] == pytest.approx([w.logprob for w in want], abs=1e-4)
        assert [[v for _, v in top] for _, top in g] == \
            [pytest.approx([v for _, v in w.top], abs=1e-4) for w in want]


def run_ranks(engine: Path, world: int, out: Path, options: dict, env: dict | None = None, mode: str = "",
              prompts: list[list[int]] = PROMPTS, **job_fields) -> dict:
    job = json.dumps({"prompts": prompts, "max_tokens": MAX_TOKENS, "options": options, "mode": mode, **job_fields})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "120", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(JOB), str(engine), str(out), job]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    # each rank's own error line first: torchrun's summary at the end names only the rank that exited first
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "Error" in line]
    assert proc.returncode == 0, "\n".join(errors[:8]) + "\n...\n" + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", sorted(MAPPINGS))
def test_ranks_match_single_rank(name, k3_short_ckpt, reference, tmp_path):
    mapping = MAPPINGS[name]
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=mapping)
    # Attention-DP spreads the prompts over two schedulers: fewer pages each to still force preemption.
    options = {**OPTIONS, "num_pages": 2} if mapping.attention_dp else OPTIONS
    got = run_ranks(engine, mapping.world_size, tmp_path / "out.json", {**options, **CUT.get(name, {})})
    torch.testing.assert_close(torch.tensor(got["logits"]), reference["logits"], rtol=1e-4, atol=1e-4)
    assert got["tokens"] == reference["tokens"]
    assert got["stats"]["preemptions"] > 0
    assert got["micro_batches"] == ([] if mapping.pp_size == 1 else [1, 2] if name in CUT else [1])
    # with pipeline stages or attention-DP another rank than the driver samples, and sends the rows
    assert_logprobs_and_penalties_match(got, reference)
    assert got.get("twice") == "request_id: 'twice' is already live" and got["twice_live"] == 0


def test_long_prefill_is_cut_by_the_estimate(k3_short_ckpt, tmp_path):
    """Two stages left to the engine's estimate (micro_batch.py): the step prefilling two prompts of 900 tokens is
    cut in two micro-batches (the tiny model's arithmetic outweighs its weights there), its decode steps are not;
    the tokens and logits are one rank's."""
    prompts = [[1] + [(7 * i) % 500 + 3 for i in range(899)], [1] + [(11 * i) % 500 + 3 for i in range(899)]]
    limits = dict(max_seq_len=2048, max_num_tokens=2048)
    llm = LLM(build_engine(k3_short_ckpt, tmp_path / "one", **limits))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(pp_size=2), **limits)
    got = run_ranks(engine, 2, tmp_path / "out.json", {}, prompts=prompts)
    assert got["micro_batches"] == [1, 2]
    assert got["tokens"] == [o.token_ids for o in llm.generate(prompts, greedy)]
    torch.testing.assert_close(torch.tensor(got["logits"]), llm.logits(prompts[0]), rtol=1e-4, atol=1e-4)


def test_deepep_adapter_matches_the_nccl_exchange(k3_tiny_ckpt, tmp_path):
    """--enable-deepep on attention-DP2 x EP2 ranks, with tests/dist/deep_ep_standin in place of DeepEP (which
    needs NVSHMEM GPUs): the backend is chosen at start-up on every rank and the whole engine runs through it.
    Its bf16 expert rows (DeepEP's combine takes bf16) differ from the NCCL exchange's fp32 sums by one rounding
    per expert; test_exchange.py checks the bookkeeping itself to that rounding."""
    engine = build_engine(k3_tiny_ckpt, tmp_path / "engine", mapping=MAPPINGS["dp2xep2"], dtype="bf16",
                          kv_dtype="bf16")
    options = {**OPTIONS, "num_pages": 2}
    nccl = run_ranks(engine, 2, tmp_path / "nccl.json", options)
    standin = str(Path(__file__).with_name("deep_ep_standin"))
    deepep = run_ranks(engine, 2, tmp_path / "deepep.json", {**options, "enable_deepep": True},
                       env={"PYTHONPATH": os.pathsep.join([standin, os.environ.get("PYTHONPATH", "")])})
    assert deepep["backend"] == "deepep" and nccl["backend"] == "nccl"
    a, b = torch.tensor(deepep["logits"]), torch.tensor(nccl["logits"])
    assert ((a - b).norm() / b.norm()).item() < 3e-2  # the spec's parity bar
    assert [len(t) for t in deepep["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    # that rounding moves no token of the nine-layer tiny model's generations (ragged batches, preemption under 2
    # pages; the six-layer one of conftest.py has a near tie it flips)
    assert deepep["tokens"] == nccl["tokens"]


def test_torchrun_generate_cli_matches_single_rank(k3_short_ckpt, k3_short_engine, tmp_path):
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    args = ["generate", "--prompt", "Hello there", "--max-tokens", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, "-m", "k3runtime.cli", args[0], str(k3_short_engine), *args[1:]],
                            env=env, capture_output=True, text=True, timeout=300)
    multi = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "-m", "k3runtime.dist.launch", str(engine), *args], env=env, capture_output=True,
                           text=True, timeout=300)
    assert single.returncode == 0 and multi.returncode == 0, multi.stderr[-3000:]
    assert "-> 8 tokens (length)" in multi.stdout
    assert multi.stdout == single.stdout
    # the same command without torchrun: the one to run instead, with the engine's own process count
    alone = subprocess.run([sys.executable, "-m", "k3runtime.cli", args[0], str(engine), *args[1:]], env=env,
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode != 0 and "runs under torchrun: `torchrun --nproc-per-node 2 -m" in alone.stderr, \
        alone.stderr[-2000:]
    # a user's error under torchrun: the command's one line on rank 0, a worker's own with its rank, no traceback
    # of ours (torchrun's summary of the failed ranks follows)
    # ... and a rank that fails to load: its error, and rank 0's one line naming it (not gloo's lost connection)
    cut = Path(shutil.copytree(engine, tmp_path / "cut"))
    weights = cut / "rank1" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    for nproc, where, flags, want in (
            (2, engine, ["--max-tokens", "0"], ["Error: --max-tokens: expected an int in 1..1048576"]),
            (3, engine, [], ["Error (rank 2): the engine has 2 ranks but torchrun started 3"]),
            (2, cut, [], ["Error (rank 1): ", "weights.safetensors: corrupt",
                          "Error (rank 0): rank 1 left the job (its own error says why)"])):
        bad = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", "-m", "k3runtime.dist.launch", str(where), *args[:3],
                              *flags], env=env, capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and all(w in bad.stderr for w in want), bad.stderr[-3000:]
        assert "[rank0]: Traceback" not in bad.stderr and "[rank1]: Traceback" not in bad.stderr, bad.stderr[-3000:]


# tp2xep2 is left to the synchronous test: its MoE groups do not touch the ids' route (the driver broadcasts them to
# every rank, as with tp2)
@pytest.mark.parametrize("name", ["tp2", "pp2xtp2", "dp2xep2"])
def test_async_scheduling_ranks_match_single_rank(name, k3_short_ckpt, reference, tmp_path):
    """Async scheduling over ranks: the rank that samples (the driver; with pipeline stages the last stage's
    first rank) broadcasts each step's sampled ids to the others on the device and every rank feeds them to the
    next step, micro-batch by micro-batch (attention-DP: each DP rank feeds its own, and sends them to the driver
    once it has launched its next step); the same tokens and scores as one synchronous rank, with preemption."""
    mapping = MAPPINGS[name]
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=mapping)
    options = {**OPTIONS, "num_pages": 2} if mapping.attention_dp else OPTIONS
    got = run_ranks(engine, mapping.world_size, tmp_path / "out.json",
                    {**options, "async_scheduling": True, **CUT.get(name, {})})
    torch.testing.assert_close(torch.tensor(got["logits"]), reference["logits"], rtol=1e-4, atol=1e-4)
    assert got["tokens"] == reference["tokens"]
    assert got["stats"]["preemptions"] > 0
    # the rows go by the ids' route: broadcast on the device with pipeline stages, owed with attention-DP
    assert_logprobs_and_penalties_match(got, reference)


@pytest.mark.parametrize("name", ["tp2", "pp2xtp2", "dp2xep2"])
def test_swap_preemption_ranks_match_single_rank(name, k3_short_ckpt, reference, tmp_path):
    """Preemption by swapping to the host over ranks, with async scheduling: every rank copies its own slice of
    the swapped pages and KDA slots to its host store and back; the same tokens and scores as one synchronous
    rank that recomputes."""
    mapping = MAPPINGS[name]
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=mapping)
    options = {**OPTIONS, "num_pages": 2} if mapping.attention_dp else OPTIONS
    options = {**options, "preemption_mode": "swap", "num_host_pages": 16, "num_host_slots": 8,
               "async_scheduling": True, **CUT.get(name, {})}
    got = run_ranks(engine, mapping.world_size, tmp_path / "out.json", options)
    torch.testing.assert_close(torch.tensor(got["logits"]), reference["logits"], rtol=1e-4, atol=1e-4)
    assert got["tokens"] == reference["tokens"]
    assert got["stats"]["swaps_out"] > 0


def test_idle_driver_keeps_its_workers(k3_short_ckpt, reference, tmp_path):
    """Pauses longer than the collective timeout (3 s here) between generations, and inside a stream whose step
    may be in flight (attention-DP with async scheduling: the other DP rank owes its ids meanwhile): the workers
    wait for the next step all the while (dist/keep_alive.py), and the tokens are the single rank's. Rank 1 also
    reads its weights 5 s after rank 0: the ranks wait for each other's load under its own timeout. Before, either
    took the job down at the collective timeout."""
    mapping = MAPPINGS["dp2xep2"]
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=mapping)
    got = run_ranks(engine, mapping.world_size, tmp_path / "out.json", {"async_scheduling": True},
                    env={"K3_DIST_TIMEOUT_S": "3"}, mode="idle", prompts=PROMPTS[1:3], idle_s=5,
                    load_delay_s={"1": 5})
    assert got["first"] == got["again"] == reference["tokens"][1:3]
    assert got["streamed"] == reference["tokens"][1]


@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2xep2"])
def test_async_scheduling_scores_between_steps(name, k3_short_ckpt, reference, tmp_path):
    """A prompt scored while async steps are in flight (attention-DP: the other DP rank's step collected by idle
    steps first) and again after the last: the single rank's logits both times; the steps' tokens its tokens, but
    a prefix for the request aborted with its step in flight; a shutdown with steps in flight lands them and
    releases the workers."""
    mapping = MAPPINGS[name]
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=mapping)
    # pages enough for the score beside the steps (no preemption)
    options = {"max_prefill_chunk": 16, "async_scheduling": True}
    got = run_ranks(engine, mapping.world_size, tmp_path / "out.json", options, mode="score_mid")
    for key in ("logits", "logits_after"):
        torch.testing.assert_close(torch.tensor(got[key]), reference["logits"], rtol=1e-4, atol=1e-4)
    cut = got["tokens"][1]
    assert 0 < len(cut) < MAX_TOKENS and cut == reference["tokens"][1][:len(cut)]
    others = [i for i in range(len(PROMPTS)) if i != 1]
    assert [got["tokens"][i] for i in others] == [reference["tokens"][i] for i in others]
    assert got["in_flight_at_shutdown"]
    if mapping.attention_dp:  # the other DP rank had a step in flight when the first score came
        assert got["collected_in_flight"] >= 1
