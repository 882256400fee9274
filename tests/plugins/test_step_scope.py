"""k3plugins.step_scope: a step's derived index tensors are made once for the same batch tensors, within a step
only; and the executor runs each step in a scope."""
import torch

from k3plugins.step_scope import per_step, step_scope


def test_per_step_reuses_within_a_step_for_the_same_sources_only():
    calls = []

    def make(a, b):
        calls.append(1)
        return a + b

    x, y = torch.arange(4), torch.ones(4, dtype=torch.int64)
    first = per_step("sum", (x, y), make)
    second = per_step("sum", (x, y), make)
    assert len(calls) == 2 and first is not second            # outside a step: computed on every call
    with step_scope():
        a = per_step("sum", (x, y), make)
        b = per_step("sum", (x, y), make)                      # a later layer of the same step
        assert a is b and len(calls) == 3
        z = x.clone()                                          # equal values, another batch tensor
        c = per_step("sum", (z, y), make)
        assert c is not a and torch.equal(c, a) and len(calls) == 4
        with step_scope():                                     # a nested step starts empty
            per_step("sum", (z, y), make)
            assert len(calls) == 5
        assert per_step("sum", (z, y), make) is c              # and the outer one is back
    per_step("sum", (x, y), make)
    assert len(calls) == 6                                     # the step's results are gone with it


def test_executor_runs_each_step_in_a_scope(k3_tiny_engine):
    """A real engine step: every layer's plugin runs inside the step's scope (what the device plugins rely on),
    one scope a step, and none is left open after it."""
    from k3plugins import step_scope as scope_mod
    from k3runtime import LLM, SamplingParams

    llm = LLM(k3_tiny_engine)
    executor = llm.engine.runner.executor
    scopes = []
    for node in [n for n in executor.nodes if n.kind in ("kda", "mla")]:
        fn = node.fn

        def spy(*args, _fn=fn, **kw):
            scopes.append(scope_mod._scope)
            return _fn(*args, **kw)
        node.fn = spy
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    layers = len([n for n in executor.nodes if n.kind in ("kda", "mla")])
    assert len(scopes) == 3 * layers and all(s is not None for s in scopes)
    steps = [scopes[i * layers:(i + 1) * layers] for i in range(3)]
    assert all(all(s is step[0] for s in step) for step in steps)       # one scope through a step's layers
    assert steps[0][0] is not steps[1][0] and scope_mod._scope is None   # a new one each step, none left open
