"""Request and SamplingParams, and the rule that bookkeeping modules never import torch."""

import ast
from pathlib import Path

import pytest

from k3runtime.request import Request, RequestStatus
from k3runtime.sampling_params import MAX_TOKENS_LIMIT, SamplingParams

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
PURE = ["request.py", "sampling_params.py", "scheduler.py", "scheduler_config.py", "kv_cache/page_pool.py",
        "kv_cache/slot_pool.py", "kv_cache/__init__.py"]
STDLIB_OK = {"__future__", "bisect", "collections", "dataclasses", "enum", "itertools", "math", "random", "time",
             "typing", "importlib"}


def test_defaults_match_the_contract():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == \
        (16, 1.0, 1.0, 0, None, (), (), False)
    assert SamplingParams(temperature=0).greedy and not p.greedy
    with pytest.raises(AttributeError):
        p.max_tokens = 3


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", MAX_TOKENS_LIMIT + 1), ("max_tokens", 2.0),
    ("max_tokens", True), ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("seed", -1), ("seed", 1 << 63), ("seed", "7"),
    ("stop", ("ok", "")), ("stop", 3), ("stop_token_ids", (1, -2)), ("stop_token_ids", "12"), ("ignore_eos", 1)])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_sequences_are_normalized_to_tuples():
    p = SamplingParams(stop="\n\n", stop_token_ids=[5, 6])
    assert p.stop == ("\n\n",) and p.stop_token_ids == (5, 6) and hash(p) == hash(SamplingParams(stop=["\n\n"], stop_token_ids=(5, 6)))


def test_choices_are_seeded_apart_and_wrap():
    """SamplingParams.choices: n params of n 1, seeds seed + j modulo 2**63 (the last seed's next is 0); unseeded
    choices stay unseeded (each request draws its own)."""
    top = (1 << 63) - 1
    picks = SamplingParams(seed=top, n=3, temperature=0.7).choices()
    assert [c.seed for c in picks] == [top, 0, 1] and {c.n for c in picks} == {1}
    assert all(c.temperature == 0.7 for c in picks)
    assert [c.seed for c in SamplingParams(n=2).choices()] == [None, None]
    assert len(SamplingParams(seed=5).choices(4)) == 4


def test_request_token_views():
    r = Request("a", [5, 6, 7], SamplingParams(seed=9))
    r.output_token_ids += [8, 9]
    assert r.all_token_ids == [5, 6, 7, 8, 9] and r.num_tokens == 5 and r.num_output_tokens == 2
    for start in range(6):
        for stop in range(start, 6):
            assert list(r.token_slice(start, stop)) == r.all_token_ids[start:stop]
    assert r.status is RequestStatus.WAITING and not r.is_finished and r.sampling_seed == 9


def test_unseeded_requests_get_a_fixed_random_seed():
    a, b = Request("a", [1]), Request("b", [1])
    assert a.sampling_seed != b.sampling_seed and 0 <= a.sampling_seed < 1 << 63


@pytest.mark.parametrize("kw,field", [({"request_id": ""}, "request_id"), ({"prompt_token_ids": []}, "prompt_token_ids"),
                                      ({"prompt_token_ids": [1, -1]}, "prompt_token_ids"),
                                      ({"params": {"max_tokens": 3}}, "params")])
def test_request_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        Request(**{"request_id": "r", "prompt_token_ids": [1], **kw})


def _relative_targets(path: str, node: ast.ImportFrom) -> list[str]:
    """The files (relative to runtime/) that `from .x import y` in runtime/`path` may load: x's module or package,
    or with `from . import y`, each y as a module or package of its own."""
    base = (RUNTIME / path).parent
    for _ in range(node.level - 1):
        base = base.parent
    names = [node.module] if node.module else [a.name for a in node.names]
    out = []
    for name in names:
        stem = base / name.replace(".", "/")
        found = stem.with_suffix(".py") if stem.with_suffix(".py").exists() else stem / "__init__.py"
        out.append(found.relative_to(RUNTIME).as_posix())
    return out


def test_relative_imports_resolve_to_files():
    """The walker's rule on the forms it meets: `from .x import y` names x, `from . import y` names y."""
    resolve = lambda src: _relative_targets("scheduler.py", ast.parse(src).body[0])  # noqa: E731
    assert resolve("from .kv_cache.page_pool import PagePool") == ["kv_cache/page_pool.py"]
    assert resolve("from .kv_cache import PagePool") == ["kv_cache/__init__.py"]
    assert resolve("from . import sampler, request") == ["sampler.py", "request.py"]  # sampler imports torch
    assert _relative_targets("kv_cache/page_pool.py", ast.parse("from ..request import Request").body[0]) == \
        ["request.py"]


@pytest.mark.parametrize("path", PURE)
def test_bookkeeping_imports_no_tensor_library(path):
    tree = ast.parse((RUNTIME / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: only into other pure modules
                for target in _relative_targets(path, node):
                    assert target in PURE, f"{path} imports {target}, which is not among the pure modules"
                continue
            names = [node.module]
        else:
            continue
        for name in names:
            assert name.split(".")[0] in STDLIB_OK, f"{path} imports {name}"


def test_scheduler_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, k3runtime.scheduler, k3runtime.kv_cache; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
