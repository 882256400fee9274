"""Logit bias and penalties on a step's rows, against the oracle (oracles/penalties.py: transformers' own logits
processors and OpenAI's formula) one row at a time; SamplingParams' checks of the four fields."""

import pytest
import torch
from oracles.penalties import penalized_logits

from k3runtime.penalties import adjust_logits
from k3runtime.sampler import ROWS_PER_PASS
from k3runtime.sampling_params import SamplingParams
from k3runtime.scheduler import SeenTokens

V = 40


def _case(g: torch.Generator, i: int):
    """Row i's params, prompt and output (some rows set nothing, some one thing, some everything)."""
    kind = i % 5
    prompt = torch.randint(0, V, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
    output = torch.randint(0, V // 2, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
    bias = {int(t): float(b) for t, b in zip(torch.randperm(V, generator=g)[:3], (torch.rand(3, generator=g) * 200 - 100))}
    kw = [{}, {"logit_bias": bias}, {"repetition_penalty": 1.7},
          {"frequency_penalty": 0.6, "presence_penalty": -0.4},
          {"repetition_penalty": 0.8, "frequency_penalty": -1.1, "presence_penalty": 2.0, "logit_bias": bias}][kind]
    return SamplingParams(**kw), prompt, output


@pytest.mark.parametrize("rows", [5, ROWS_PER_PASS + 9])
def test_rows_match_transformers_and_openai(rows):
    g = torch.Generator().manual_seed(rows)
    cases = [_case(g, i) for i in range(rows)]
    logits = torch.randn(rows, V, generator=g) * 3
    logits[0, 5] = float("-inf")  # a masked token stays masked
    # every other penalized row has its last output token on the device (async scheduling's pending token)
    pending, seen = [], []
    for i, (p, prompt, output) in enumerate(cases):
        late = p.penalized and output and i % 2 == 0
        pending.append(output[-1] if late else -1)
        known = output[:-1] if late else output
        seen.append(SeenTokens(tuple(prompt) if p.repetition_penalty != 1.0 else (), tuple(known))
                    if p.penalized else None)
    got = adjust_logits(logits, [c[0] for c in cases], seen, torch.tensor(pending))
    for i, (p, prompt, output) in enumerate(cases):
        want = penalized_logits(logits[i], p, prompt, output)
        if not (p.penalized or p.logit_bias):
            assert torch.equal(got[i], logits[i]), i  # untouched, bit for bit
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5, msg=f"row {i}: {p}")


def test_a_step_without_any_returns_its_logits():
    logits = torch.randn(3, V)
    assert adjust_logits(logits, [SamplingParams()] * 3, [None] * 3) is logits


def test_penalties_change_only_seen_tokens_and_counts_matter():
    x = torch.zeros(1, V) + 1.0
    p = SamplingParams(frequency_penalty=0.5)
    y = adjust_logits(x, [p], [SeenTokens((), (3, 3, 3, 7))])[0]
    assert y[3].item() == pytest.approx(-0.5) and y[7].item() == pytest.approx(0.5)
    assert torch.equal(y[[i for i in range(V) if i not in (3, 7)]], x[0, :V - 2])


@pytest.mark.parametrize("field,value,msg", [
    ("presence_penalty", 2.5, "presence_penalty: expected a number in \\[-2, 2\\]"),
    ("frequency_penalty", float("nan"), "frequency_penalty: expected a number in \\[-2, 2\\]"),
    ("frequency_penalty", True, "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty: expected a finite number > 0"),
    ("repetition_penalty", float("inf"), "repetition_penalty"),
    ("logit_bias", {5: 101.0}, "logit_bias\\[5\\]: expected a number in \\[-100, 100\\]"),
    ("logit_bias", {-1: 1.0}, "logit_bias: token id -1: expected an int >= 0"),
    ("logit_bias", {"5": 1.0}, "logit_bias: token id '5'"),
    ("logit_bias", [(5, 1.0), (5, 2.0)], "logit_bias: token id 5 is given twice"),
    ("logit_bias", [5], "logit_bias: expected"),
])
def test_bad_values_name_their_field(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**{field: value})


def test_values_are_normalised_and_hashable():
    p = SamplingParams(logit_bias={9: 1, 2: -3}, presence_penalty=1, repetition_penalty=2)
    assert p.logit_bias == ((2, -3.0), (9, 1.0)) and p.presence_penalty == 1.0 and p.penalized
    assert hash(p) == hash(SamplingParams(logit_bias=[(2, -3.0), (9, 1.0)], presence_penalty=1.0,
                                          repetition_penalty=2.0))
    assert not SamplingParams(logit_bias={1: 2.0}).penalized


def test_counts_kept_by_slot_equal_whole_outputs_each_step():
    """A rank's SeenCounts over 30 steps of 6 rows: each row's output grows by one token a step and comes as a delta
    (fresh at first, and whenever its slot passes to another request); the logits equal those from the whole
    outputs each step, and slots move between rows."""
    from k3runtime.penalties import SeenCounts
    g = torch.Generator().manual_seed(4)
    store = SeenCounts()
    params = [SamplingParams(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.3)] * 6
    prompts = [tuple(sorted(set(torch.randint(0, V, (5,), generator=g).tolist()))) for _ in range(6)]
    outputs, counted, slots = [[] for _ in range(6)], [None] * 6, [9, 2, 5, 0, 7, 3]
    for step in range(30):
        if step in (10, 20):  # rows 1 and 4 swap slots, row 0 starts a new request (a new output) in its slot
            slots[1], slots[4] = slots[4], slots[1]
            counted[1] = counted[4] = counted[0] = None
            outputs[0] = []
        seen = [SeenTokens(prompts[r], tuple(outputs[r])) if counted[r] is None else
                SeenTokens((), tuple(outputs[r][counted[r]:]), counted[r], fresh=False) for r in range(6)]
        logits = torch.randn(6, V, generator=g)
        got = adjust_logits(logits, params, seen, slots=slots, store=store)
        want = adjust_logits(logits, params, [SeenTokens(prompts[r], tuple(outputs[r])) for r in range(6)])
        assert torch.equal(got, want), step
        for r in range(6):
            counted[r] = len(outputs[r])
            outputs[r].append(int(torch.randint(0, V, (1,), generator=g)))


def test_a_step_that_does_not_start_where_the_counts_end_is_refused():
    from k3runtime.penalties import SeenCounts
    store = SeenCounts()
    p = [SamplingParams(frequency_penalty=1.0)]
    adjust_logits(torch.zeros(1, V), p, [SeenTokens((), (3, 4))], slots=[6], store=store)
    with pytest.raises(ValueError, match="slot 6: the step brings output tokens from index 3, this rank's counts "
                                         "hold 2"):
        adjust_logits(torch.zeros(1, V), p, [SeenTokens((), (5,), 3, fresh=False)], slots=[6], store=store)
    with pytest.raises(ValueError, match="slot 1: .* counts hold none"):
        adjust_logits(torch.zeros(1, V), p, [SeenTokens((), (5,), 0, fresh=False)], slots=[1], store=store)


def test_counts_take_the_ranks_slots_at_once():
    """Given the rank's slot count, the counts are allocated for all of them at the first penalized step (what the
    memory plan reserves), and a slot past them is refused by name."""
    from k3runtime.penalties import SeenCounts
    store = SeenCounts(num_slots=4)
    p = [SamplingParams(presence_penalty=1.0)]
    adjust_logits(torch.zeros(1, V), p, [SeenTokens((), (3,))], slots=[1], store=store)
    assert tuple(store.counts.shape) == tuple(store.prompt.shape) == (4, V)
    with pytest.raises(ValueError, match="slot 4: this rank's penalty counts hold 4 slots"):
        adjust_logits(torch.zeros(1, V), p, [SeenTokens((), (3,))], slots=[4], store=store)
