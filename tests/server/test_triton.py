"""A real tritonserver (nvidia-pytriton's 2.51 build) on a generated repository, real tritonclient calls.

Greedy results over HTTP (unary model) and gRPC streaming (decoupled model) equal the Python API's;
bad inputs get errors naming the input; SIGTERM stops the server and its stubs (no orphans).
The stub's environment comes from tools/triton_env.sh (numpy<2 venv); it is built here if missing.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from liveness import free_port

from k3runtime import SamplingParams
from k3runtime.triton_backend.launch import DEFAULT_VENV, TritonServer, find_env
from k3runtime.triton_backend.repo import config_pbtxt, write_repo

ROOT = Path(__file__).parents[2]


def _ports(n=3):
    ports = set()
    while len(ports) < n:
        ports.add(free_port())
    return tuple(ports)


def test_config_pbtxt_shape(tmp_path):
    txt = config_pbtxt("k3", tmp_path, decoupled=True)
    for name in ["text_input", "input_ids", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
                 "stop",
                 "return_log_probs", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "text_output",
                 "output_ids",
                 "finish_reason", "output_log_probs"]:
        assert f'name: "{name}"' in txt
    assert 'backend: "python"' in txt and "decoupled: true" in txt and str(tmp_path) in txt
    unary = config_pbtxt("k3", tmp_path, decoupled=False, max_batch_size=8)
    assert "decoupled" not in unary and "max_batch_size: 0" in txt
    # the unary model takes the requests queued while it runs together; prompts and stops of any length
    assert "max_batch_size: 8" in unary and "dynamic_batching" in unary and "dynamic_batching" not in txt
    assert unary.count("allow_ragged_batch: true") == 3 and "allow_ragged_batch" not in txt
    with pytest.raises(FileNotFoundError, match="not a k3build engine"):
        write_repo(tmp_path, tmp_path / "repo")


def test_parameters_become_engine_options(tmp_path):
    """What triton-repo writes is what the model reads: an option not given (async scheduling too) is left to the
    engine; a bad value names its parameter."""
    from k3runtime.triton_backend.params import engine_options

    assert "async_scheduling" not in config_pbtxt("k3", tmp_path, decoupled=True, async_scheduling=None)
    assert "num_pages" not in config_pbtxt("k3", tmp_path, decoupled=True)
    txt = config_pbtxt("k3", tmp_path, decoupled=True, device="cuda", num_pages=7, max_num_seqs=3,
                       preemption_mode="swap", num_host_pages=4, num_host_slots=2, async_scheduling=False)
    params = dict(re.findall(r'key: "(\w+)"\n  value: \{ string_value: "([^"]*)" \}', txt))
    opts = engine_options(params)
    assert (opts.device, opts.num_pages, opts.max_num_seqs, opts.async_scheduling) == ("cuda", 7, 3, False)
    assert (opts.preemption_mode, opts.num_host_pages, opts.num_host_slots) == ("swap", 4, 2)
    assert engine_options({"async_scheduling": "True"}).async_scheduling is True
    txt = config_pbtxt("k3", tmp_path, decoupled=True, preemption_mode="swap", swap_space_gib=0.5)
    params = dict(re.findall(r'key: "(\w+)"\n  value: \{ string_value: "([^"]*)" \}', txt))
    assert engine_options(params).swap_space_gib == 0.5
    txt = config_pbtxt("k3", tmp_path, decoupled=True, verify_weights=True)
    params = dict(re.findall(r'key: "(\w+)"\n  value: \{ string_value: "([^"]*)" \}', txt))
    assert engine_options(params).verify_weights is True and engine_options({}).verify_weights is False
    assert engine_options({}) == engine_options({"num_slots": ""})  # an empty parameter is not set
    assert engine_options({}).async_scheduling is None and engine_options({}).device == "cpu"
    for bad, why in [({"async_scheduling": "yes"}, "parameter async_scheduling must be true or false, got 'yes'"),
                     ({"num_pages": "0"}, "parameter num_pages must be an integer >= 1, got '0'"),
                     ({"num_slots": "\u00b2"}, "parameter num_slots must be an integer >= 1"),
                     ({"num_host_pages": "-1"}, "parameter num_host_pages must be an integer >= 0, got '-1'"),
                     ({"swap_space_gib": "-0.5"}, "parameter swap_space_gib must be a number > 0, got '-0.5'"),
                     ({"preemption_mode": "drop"}, "parameter preemption_mode must be one of recompute, swap"),
                     ({"preemption_mode": "swap"}, "parameters: preemption_mode 'swap' needs a host store")]:
        with pytest.raises(ValueError, match=why):
            engine_options(bad)


def test_triton_repo_refuses_bad_options(tiny_engine, tmp_path):
    """Refused when the repository is written, not when tritonserver loads it, by the options' names: nothing is
    written, and a model there already is kept, --overwrite or not."""
    from click.testing import CliRunner

    from k3runtime.cli import main

    repo = tmp_path / "repo"
    res = CliRunner().invoke(main, ["triton-repo", str(tiny_engine), str(repo), "--num-host-pages", "3"])
    assert res.exit_code != 0 and "need --preemption-mode 'swap'" in res.output
    assert not repo.exists()
    write_repo(tiny_engine, repo, num_pages=4)
    before = (repo / "k3" / "config.pbtxt").read_text()
    res = CliRunner().invoke(main, ["triton-repo", str(tiny_engine), str(repo), "--overwrite", "--preemption-mode",
                                    "swap"])
    assert res.exit_code != 0 and "--preemption-mode 'swap' needs a host store" in res.output
    assert (repo / "k3" / "config.pbtxt").read_text() == before
    res = CliRunner().invoke(main, ["triton-repo", str(tiny_engine), str(repo), "--overwrite",
                                    "--max-num-batched-tokens", "100000"])
    assert res.exit_code != 0 and "--max-num-batched-tokens 100000 is past the engine's max_num_tokens" in res.output
    assert (repo / "k3" / "config.pbtxt").read_text() == before
    slots = json.loads((tiny_engine / "config.json").read_text())["memory_plan"]["num_slots"]
    res = CliRunner().invoke(main, ["triton-repo", str(tiny_engine), str(repo), "--overwrite", "--no-decoupled",
                                    "--max-num-seqs", str(slots + 1)])  # the model would fail when Triton loads it
    assert res.exit_code != 0 and f"--max-num-seqs {slots + 1} is past the engine's {slots} KDA state slots" in \
        res.output, res.output
    assert (repo / "k3" / "config.pbtxt").read_text() == before
    max_len = json.loads((tiny_engine / "config.json").read_text())["build_config"]["max_seq_len"]
    res = CliRunner().invoke(main, ["triton-repo", str(tiny_engine), str(repo), "--overwrite", "--max-tokens-limit",
                                    str(max_len + 1)])
    want = (f"--max-tokens-limit: {max_len + 1} is past what the engine holds, {max_len} tokens a sequence (its "
            f"max_seq_len), so at most {max_len}")
    assert res.exit_code != 0 and want in res.output, res.output
    assert f'key: "max_tokens_limit"\n  value: {{ string_value: "{max_len}" }}' in before  # serve's default too
    with pytest.raises(TypeError, match=r"not engine flags: \['num_page'\]"):
        write_repo(tiny_engine, repo, overwrite=True, num_page=7)
    for flags, says in ((["--model-name", "a b/c"], "--model-name: 'a b/c' is not a Triton model name"),
                        (["--device", "bogus"], "--device: expected cpu, cuda or cuda:N")):
        res = CliRunner().invoke(main, ["triton-repo", str(tiny_engine), str(repo), "--overwrite", *flags])
        assert res.exit_code != 0 and says in res.output, res.output
    assert sorted(p.name for p in repo.iterdir()) == ["k3"]
    # a cpu engine on a GPU fails wherever Triton loads it; inside the engine dir, a later build would refuse it
    for out, flags, says in ((repo, ["--device", "cuda"], "engine built for target 'cpu' but --device cuda is a GPU"),
                             (tiny_engine / "repo", [], "inside the engine")):
        res = CliRunner().invoke(main, ["triton-repo", str(tiny_engine), str(out), "--overwrite", *flags])
        assert res.exit_code == 1 and says in res.output and "Traceback" not in res.output, res.output
    assert sorted(p.name for p in repo.iterdir()) == ["k3"] and not (tiny_engine / "repo").exists()


# appended to k3_gated's model.py: its responses go out only while the file GATE exists, whichever thread sends them
GATED_SEND = """

import os as _os
import time as _time


class _GatedSender:
    def __init__(self, sender):
        self.sender = sender

    def send(self, *args, **kwargs):
        while not _os.path.exists(GATE):
            _time.sleep(0.005)
        return self.sender.send(*args, **kwargs)


class _GatedRequest:
    def __init__(self, request):
        self.request = request

    def __getattr__(self, name):
        return getattr(self.request, name)

    def get_response_sender(self):
        return _GatedSender(self.request.get_response_sender())


_execute = TritonPythonModel.execute
TritonPythonModel.execute = lambda self, requests: _execute(self, [_GatedRequest(r) for r in requests])
"""


def _gate(triton) -> Path:
    return triton.workdir / "send_gate"


@pytest.fixture(scope="module")
def triton(tiny_engine, tmp_path_factory):
    try:
        env = find_env(DEFAULT_VENV)
    except FileNotFoundError:
        r = subprocess.run(["bash", str(ROOT / "tools/triton_env.sh"), str(DEFAULT_VENV)], capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, f"tools/triton_env.sh failed:\n{r.stdout}\n{r.stderr}"
        env = find_env(DEFAULT_VENV)
    work = tmp_path_factory.mktemp("triton")
    write_repo(tiny_engine, work / "repo", model_name="k3", decoupled=True, max_tokens_limit=64)
    write_repo(tiny_engine, work / "repo", model_name="k3_unary", decoupled=False, max_tokens_limit=1000)
    # a model whose engine fails at its first step (its stub's LLMEngine.step replaced): how a stopped engine is told
    for name, decoupled in (("k3_dies", False), ("k3_dies_stream", True)):
        dies = write_repo(tiny_engine, work / "repo", model_name=name, decoupled=decoupled)
        with open(dies / "1" / "model.py", "a") as f:
            f.write("\n\nfrom k3runtime.llm_engine import LLMEngine\n\n\ndef _fail(self, *a, **k):\n"
                    "    raise RuntimeError('injected step failure')\n\n\nLLMEngine.step = _fail\n")
    no_tok = shutil.copytree(tiny_engine, work / "engine_no_tokenizer")  # takes token ids only
    (no_tok / "tokenizer.json").unlink()
    for name, decoupled in (("k3_ids_only", False), ("k3_ids_only_stream", True)):
        write_repo(no_tok, work / "repo", model_name=name, decoupled=decoupled)
    gated = write_repo(tiny_engine, work / "repo", model_name="k3_gated", decoupled=True, max_tokens_limit=1000)
    with open(gated / "1" / "model.py", "a") as f:
        f.write(f"\n\nGATE = {str(work / 'send_gate')!r}\n" + GATED_SEND)
    (work / "send_gate").touch()
    # explicit model control (every model loaded at start) so that a test can unload and load one
    ts = TritonServer(work / "repo", work, _ports(), env=env,
                      extra_args=("--model-control-mode=explicit", "--load-model=*"))
    ts.start()
    yield ts
    kids = ts.children()
    assert kids, "expected Python-backend stub processes under tritonserver"
    assert ts.stop() == 0, ts.log_tail()
    assert not [k for k in kids if Path(f"/proc/{k}").exists()], "stub processes outlived tritonserver"


def _inputs(mod, batched=False, **values):
    """values as the client's InferInputs; batched: with the unary model's batch dimension (of 1)."""
    kinds = {"text_input": ("BYTES", np.object_), "stop": ("BYTES", np.object_), "input_ids": ("INT32", np.int32),
             "max_tokens": ("INT32", np.int32), "top_k": ("INT32", np.int32), "temperature": ("FP32", np.float32),
             "top_p": ("FP32", np.float32), "min_p": ("FP32", np.float32), "seed": ("UINT64", np.uint64),
             "stream": ("BOOL", np.bool_),
             "return_log_probs": ("BOOL", np.bool_), "presence_penalty": ("FP32", np.float32),
             "frequency_penalty": ("FP32", np.float32), "repetition_penalty": ("FP32", np.float32),
             "min_tokens": ("INT32", np.int32), "ignore_eos": ("BOOL", np.bool_), "stop_token_ids": ("INT32", np.int32),
             "skip_special_tokens": ("BOOL", np.bool_)}
    out = []
    for name, v in values.items():
        dt, npt = kinds[name]
        a = np.array(v if isinstance(v, list) else [v], dtype=npt)
        a = a[None] if batched else a
        x = mod.InferInput(name, list(a.shape), dt)
        x.set_data_from_numpy(a)
        out.append(x)
    return out


def _unary(mod, **values):
    return _inputs(mod, batched=True, **values)


def _stream(url, model, requests, on_response=lambda res: None):
    """Send each request (a dict of inputs) on one gRPC stream; returns, per request, its list of responses.
    on_response: called with each response as it arrives."""
    import tritonclient.grpc as tg

    q: queue.Queue = queue.Queue()
    c = tg.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        for i, values in enumerate(requests):
            c.async_stream_infer(model, _inputs(tg, **values), request_id=str(i), enable_empty_final_response=True)
        got = {str(i): [] for i in range(len(requests))}
        open_ = set(got)
        while open_:
            res, err = q.get(timeout=120)
            if err is not None:
                rid = err.get_response().id if hasattr(err, "get_response") else None
                raise AssertionError(f"stream error (request {rid}): {err}")
            resp = res.get_response()
            got[resp.id].append(res)
            on_response(res)
            if resp.parameters["triton_final_response"].bool_param:
                open_.discard(resp.id)
        return [got[str(i)] for i in range(len(requests))]
    finally:
        c.stop_stream()
        c.close()


def _ids(res):
    return [] if res.get_output("output_ids") is None else res.as_numpy("output_ids").tolist()


def test_http_unary_matches_python_api(triton, llm):
    import tritonclient.http as th

    c = th.InferenceServerClient(f"127.0.0.1:{triton.ports[0]}")
    try:
        assert c.is_server_ready() and c.is_model_ready("k3_unary") and c.is_model_ready("k3")
        ref = llm.generate([3, 14, 15, 92], SamplingParams(max_tokens=10, temperature=0))[0]
        r = c.infer("k3_unary", _unary(th, input_ids=[3, 14, 15, 92], max_tokens=10, temperature=0.0))
        assert r.as_numpy("output_ids").tolist() == [ref.token_ids]
        assert r.as_numpy("finish_reason")[0, 0].decode() == ref.finish_reason
        ref = llm.generate("Hello world", SamplingParams(max_tokens=8, temperature=0))[0]
        r = c.infer("k3_unary", _unary(th, text_input="Hello world", max_tokens=8, temperature=0.0))
        assert r.as_numpy("output_ids").tolist() == [ref.token_ids]
        assert r.as_numpy("text_output")[0, 0].decode() == ref.text
        assert r.as_numpy("output_log_probs").size == 0  # not asked
        # return_log_probs: each output token's log-probability, the Python API's
        ref = llm.generate("Hello world", SamplingParams(max_tokens=6, temperature=0, logprobs=0))[0]
        r = c.infer("k3_unary", _unary(th, text_input="Hello world", max_tokens=6, temperature=0.0,
                                        return_log_probs=True))
        assert r.as_numpy("output_log_probs")[0].tolist() == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    finally:
        c.close()


def test_grpc_streaming_matches_python_api(triton, llm):
    prompts = ["Hello world", "The quick brown fox", "1 2 3"]
    refs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    reqs = [dict(text_input=p, max_tokens=8, temperature=0.0, stream=True) for p in prompts]
    reqs.append(dict(text_input=prompts[0], max_tokens=8, temperature=0.0, stream=False))
    out = _stream(f"127.0.0.1:{triton.ports[1]}", "k3", reqs)
    for ref, resps in zip(refs, out[:3]):
        assert [t for r in resps for t in _ids(r)] == ref.token_ids  # one token per response, none lost
        assert len([r for r in resps if _ids(r)]) == 8
        texts = [r.as_numpy("text_output")[0].decode() for r in resps if r.get_output("text_output") is not None]
        assert "".join(texts) == ref.text
        assert resps[-1].as_numpy("finish_reason")[0].decode() == "length"
    (single,) = out[3]
    assert _ids(single) == refs[0].token_ids
    # streamed with return_log_probs: a token's log-probability in each of its responses
    ref = llm.generate(prompts[1], SamplingParams(max_tokens=5, temperature=0, logprobs=0))[0]
    (resps,) = _stream(f"127.0.0.1:{triton.ports[1]}", "k3", [dict(text_input=prompts[1], max_tokens=5,
                                                                  temperature=0.0, stream=True, return_log_probs=True)])
    assert all(r.as_numpy("output_log_probs").size == len(_ids(r)) for r in resps if _ids(r))
    got = [v for r in resps if _ids(r) for v in r.as_numpy("output_log_probs").tolist()]
    assert got == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)


def test_seed_stop_and_penalties_pass_through(triton, llm):
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=99)
    ref = llm.generate("seeded", sp)[0]
    text = llm.generate("Hello world", SamplingParams(max_tokens=16, temperature=0))[0].text
    stop_ref = llm.generate("Hello world", SamplingParams(max_tokens=16, temperature=0, stop=(text[3:5],)))[0]
    penalties = dict(presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.25)  # exact in fp32
    pen_ref = llm.generate("Hello world", SamplingParams(max_tokens=12, temperature=0, **penalties))[0]
    assert pen_ref.token_ids != llm.generate("Hello world", SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    # stop ids held back by min_tokens, past EOS (vLLM's extensions, as the Python API and the OpenAI server)
    greedy = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    stops = dict(min_tokens=2, stop_token_ids=[greedy[1], greedy[4]], ignore_eos=True)
    stop_id_ref = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, temperature=0, **stops))[0]
    assert stop_id_ref.token_ids[1] != greedy[1]  # banned under min_tokens
    # min_p 1.0 keeps the best token alone: the greedy tokens at a high temperature; 0.75 as the Python API's (it
    # and the temperature exact in fp32; the tiny model's distribution is nearly flat: a small min_p drops nothing)
    hot = dict(text_input="seeded", max_tokens=10, temperature=1.5, seed=1)
    greedy_ref = llm.generate("seeded", SamplingParams(max_tokens=10, temperature=0))[0]
    min_p_ref = llm.generate("seeded", SamplingParams(max_tokens=10, temperature=1.5, seed=1, min_p=0.75))[0]
    plain = llm.generate("seeded", SamplingParams(max_tokens=10, temperature=1.5, seed=1))[0]
    assert plain.token_ids != min_p_ref.token_ids and plain.token_ids != greedy_ref.token_ids
    e, f = _stream(f"127.0.0.1:{triton.ports[1]}", "k3", [dict(hot, min_p=1.0), dict(hot, min_p=0.75)])
    assert _ids(e[0]) == greedy_ref.token_ids and _ids(f[0]) == min_p_ref.token_ids
    a, b, c, d = _stream(f"127.0.0.1:{triton.ports[1]}", "k3", [
        dict(text_input="seeded", max_tokens=10, temperature=1.0, top_k=40, seed=99),
        dict(text_input="Hello world", max_tokens=16, temperature=0.0, stop=[text[3:5]]),
        dict(text_input="Hello world", max_tokens=12, temperature=0.0, **penalties),
        dict(input_ids=[5, 6, 7], max_tokens=8, temperature=0.0, **stops)])
    assert _ids(a[0]) == ref.token_ids
    assert _ids(b[0]) == stop_ref.token_ids and b[0].as_numpy("finish_reason")[0].decode() == "stop"
    assert _ids(c[0]) == pen_ref.token_ids
    assert _ids(d[0]) == stop_id_ref.token_ids
    assert d[0].as_numpy("finish_reason")[0].decode() == stop_id_ref.finish_reason


def test_skip_special_tokens_input(triton, special_output):
    """skip_special_tokens (BOOL, default true): special tokens left out of text_output or kept, as the tokenizer's
    own decoding spells them, streamed (gRPC) or unary (HTTP); kept, a stop string that spells one matches it."""
    import tritonclient.http as th

    hf, ref = special_output
    ids = ref.token_ids
    first = next(i for i, t in enumerate(ids) if t in hf.all_special_ids)
    spelled = hf.convert_ids_to_tokens(ids[first])
    base = dict(input_ids=ref.prompt_token_ids, max_tokens=24, temperature=0.0, ignore_eos=True)
    flags = [{}, dict(skip_special_tokens=True), dict(skip_special_tokens=False)]
    out = _stream(f"127.0.0.1:{triton.ports[1]}", "k3", [dict(base, stream=True, **f) for f in flags] +
                  [dict(base, stop=[spelled], skip_special_tokens=False)])
    for f, resps in zip(flags, out):
        assert [t for r in resps for t in _ids(r)] == ids
        text = "".join(r.as_numpy("text_output")[0].decode() for r in resps if r.get_output("text_output") is not None)
        assert text == hf.decode(ids, skip_special_tokens=f.get("skip_special_tokens", True)), f
    (stopped,) = out[3]
    assert stopped.as_numpy("finish_reason")[0].decode() == "stop"
    assert stopped.as_numpy("text_output")[0].decode() == hf.decode(ids[:first], skip_special_tokens=False)
    with th.InferenceServerClient(f"127.0.0.1:{triton.ports[0]}") as c:
        r = c.infer("k3_unary", _unary(th, skip_special_tokens=False, **base))
    assert r.as_numpy("text_output")[0, 0].decode() == hf.decode(ids, skip_special_tokens=False)


def test_bad_inputs_are_errors_and_server_keeps_serving(triton):
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    c = th.InferenceServerClient(f"127.0.0.1:{triton.ports[0]}")
    try:
        for values, words in [
            (dict(input_ids=[1, 2], max_tokens=0), "max_tokens"),
            (dict(input_ids=[1, 2], max_tokens=2000), "limit of 1000"),
            (dict(input_ids=[1, 2], temperature=-1.0), "temperature"),
            (dict(input_ids=[1, 2], repetition_penalty=0.0), "repetition_penalty"),
            (dict(input_ids=[1, 2], presence_penalty=3.0), "presence_penalty"),
            (dict(input_ids=[1, 2], min_p=1.5), r"min_p: expected a number in \[0, 1\]"),
            (dict(max_tokens=3), "exactly one"),
            (dict(input_ids=[1, 10**6]), "vocabulary"),
            (dict(input_ids=[1, 2], stream=True), "decoupled"),
            (dict(text_input=b"a\xed\xa0\x80"), "text_input: not valid UTF-8"),  # a lone surrogate's bytes
            (dict(input_ids=[1, 2], stop=[b"\xff"]), "stop: not valid UTF-8"),
        ]:
            with pytest.raises(InferenceServerException, match=words) as e:
                c.infer("k3_unary", _unary(th, **values))
            assert e.value.status() == "400", values  # the client's mistake (INVALID_ARG), not the server's
        two = th.InferInput("input_ids", [2, 2], "INT32")  # two prompts in one request: not joined into one
        two.set_data_from_numpy(np.array([[1, 2], [3, 4]], dtype=np.int32))
        with pytest.raises(InferenceServerException, match="input_ids: a batch of 2") as e:
            c.infer("k3_unary", [two])
        assert e.value.status() == "400"
        wrong = th.InferInput("max_tokens", [1, 1], "FP32")
        wrong.set_data_from_numpy(np.array([[3.0]], dtype=np.float32))
        with pytest.raises(InferenceServerException, match="data-type"):
            c.infer("k3_unary", _unary(th, input_ids=[1]) + [wrong])
        r = c.infer("k3_unary", _unary(th, input_ids=[1, 2], max_tokens=2, temperature=0.0))
        assert r.as_numpy("output_ids").shape == (1, 2)
    finally:
        c.close()
    with pytest.raises(AssertionError, match="max_tokens"):
        _stream(f"127.0.0.1:{triton.ports[1]}", "k3", [dict(text_input="x", max_tokens=-2)])


def test_tensorrt_llm_only_fields_are_refused_not_ignored(triton):
    """/generate's fields that are no input reach the model as request parameters: end_id and the other
    TensorRT-LLM names are refused naming what the model takes, not silently ignored; so are they as parameters
    of an /infer request. Plain /generate requests answer."""
    import httpx
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    base = f"http://127.0.0.1:{triton.ports[0]}/v2/models"
    for model in ("k3_unary", "k3"):
        r = httpx.post(f"{base}/{model}/generate", json={"text_input": "hi", "max_tokens": 2, "end_id": 2},
                       timeout=60)
        assert r.status_code == 400 and "end_id: not taken by this model" in r.text, r.text
        assert "stop_token_ids" in r.text, r.text
        r = httpx.post(f"{base}/{model}/generate", json={"text_input": "hi", "max_tokens": 2, "random_seed": 3},
                       timeout=60)
        assert r.status_code == 400 and "random_seed: not taken by this model" in r.text and "seed" in r.text
        ok = httpx.post(f"{base}/{model}/generate", json={"text_input": "hi", "max_tokens": 2, "temperature": 0.0},
                        timeout=60)
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2, ok.text
    c = th.InferenceServerClient(f"127.0.0.1:{triton.ports[0]}")
    try:
        with pytest.raises(InferenceServerException, match="pad_id: not taken") as e:
            c.infer("k3_unary", _unary(th, input_ids=[1, 2], max_tokens=2), parameters={"pad_id": 0})
        assert e.value.status() == "400"
    finally:
        c.close()


def test_stop_strings_without_a_tokenizer_refuse_that_request_alone(triton, llm):
    """An engine without a tokenizer cannot match stop strings: a request that sends some is refused (400, naming
    stop), and the requests sent with it, to the unary or the decoupled model, are answered as usual."""
    from concurrent.futures import ThreadPoolExecutor

    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    ref = llm.generate([[3, 14, 15]], SamplingParams(max_tokens=5, temperature=0))[0].token_ids
    url = f"127.0.0.1:{triton.ports[0]}"

    def one(values):
        with th.InferenceServerClient(url) as c:
            try:
                return c.infer("k3_ids_only", _unary(th, **values)).as_numpy("output_ids")[0].tolist()
            except InferenceServerException as e:
                return e

    asks = [dict(input_ids=[3, 14, 15], max_tokens=5, temperature=0.0, stop=["x"])] + \
        [dict(input_ids=[3, 14, 15], max_tokens=5, temperature=0.0)] * 3
    with ThreadPoolExecutor(len(asks)) as pool:
        refused, *answered = pool.map(one, asks)
    assert isinstance(refused, InferenceServerException) and refused.status() == "400", refused
    assert "stop: stop strings need the engine's tokenizer" in str(refused)
    assert answered == [ref] * 3
    grpc = f"127.0.0.1:{triton.ports[1]}"
    with pytest.raises(AssertionError, match="stop strings need the engine's tokenizer"):
        _stream(grpc, "k3_ids_only_stream", [dict(input_ids=[3, 14, 15], max_tokens=5, stop=["x"])])
    out = _stream(grpc, "k3_ids_only_stream", [dict(input_ids=[3, 14, 15], max_tokens=5, temperature=0.0)])
    assert [t for res in out[0] for t in _ids(res)] == ref


def _unary_counts(c, model="k3_unary"):
    """(requests answered, executions) of a model, from Triton's statistics."""
    st = c.get_inference_statistics(model)["model_stats"][0]
    return int(st.get("inference_count", 0)), int(st.get("execution_count", 0))


def test_unary_model_batches_requests_that_wait(triton, llm):
    """Requests sent together to the unary model run together in the engine (the dynamic batcher hands them to one
    execute; ragged prompts), each answered with exactly the Python API's tokens."""
    from concurrent.futures import ThreadPoolExecutor

    import tritonclient.http as th

    prompts = [[3, 14, 15, 92], [7] * 11, [2, 7, 1, 8, 2, 8], [5], [9, 9, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    refs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    url = f"127.0.0.1:{triton.ports[0]}"
    with th.InferenceServerClient(url) as c:
        inf0, ex0 = _unary_counts(c)

    def one(ids):
        with th.InferenceServerClient(url) as c:
            return c.infer("k3_unary", _unary(th, input_ids=ids, max_tokens=24, temperature=0.0)).as_numpy("output_ids")

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert [g[0].tolist() for g in got] == [r.token_ids for r in refs]
    with th.InferenceServerClient(url) as c:
        inf1, ex1 = _unary_counts(c)
    # one at a time would be one execution a request; the first runs alone, the others queue behind it together
    assert inf1 - inf0 == len(prompts) and ex1 - ex0 < len(prompts), (inf1 - inf0, ex1 - ex0)


def _metrics_text(triton, until=lambda text: True, deadline_s=30.0) -> str:
    """Triton's /metrics page, polled until `until` holds (or the deadline)."""
    import urllib.request

    deadline = time.monotonic() + deadline_s
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{triton.ports[2]}/metrics", timeout=10).read().decode()
        if until(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.02)


def _metric(triton, name, deadline_s=30.0, until=lambda v: True):
    """The value of one sample of Triton's /metrics (0 when absent), polled until `until` holds (or the deadline)."""
    def value(text):
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return value(_metrics_text(triton, lambda text: until(value(text)), deadline_s))


def test_metrics_show_the_engines_cache(triton, tiny_engine):
    """Each model's engine snapshot in Triton's metrics, as `serve` shows it: the cache's sizes (the engine's memory
    plan), pages in use back to 0 after a request, no host store, and the preemption counters (0 here)."""
    import tritonclient.grpc as tg

    plan = json.loads((tiny_engine / "config.json").read_text())["memory_plan"]
    with tg.InferenceServerClient(f"127.0.0.1:{triton.ports[1]}") as c:
        c.infer("k3_unary", _unary(tg, input_ids=[5, 6], max_tokens=3, temperature=0.0))
    label = '{model="k3_unary"}'
    assert _metric(triton, f"k3_kv_pages_total{label}", until=lambda v: v > 0) == plan["num_pages"]
    assert _metric(triton, f"k3_kda_slots_total{label}") == plan["num_slots"]
    assert _metric(triton, f"k3_kv_pages_used{label}", until=lambda v: v == 0) == 0
    text = _metrics_text(triton)
    for name in ("k3_host_pages_total", "k3_host_slots_used", "k3_preemptions_total", "k3_requests_swapped_out_total",
                 "k3_requests_running"):
        assert re.search(rf"^{name}{re.escape(label)} 0$", text, re.M), name


def test_unary_request_cancelled_by_its_client_is_aborted(triton, llm):
    """A gRPC client that gives up (client_timeout) cancels its request: the unary model aborts it on the engine
    (its pages and slot freed; Triton's metrics count it as finished by "abort"), and the next request is answered."""
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    aborted = 'k3_requests_finished_total{finish_reason="abort",model="k3_unary"}'
    before = _metric(triton, aborted)
    with tg.InferenceServerClient(f"127.0.0.1:{triton.ports[1]}") as c:
        with pytest.raises(InferenceServerException, match="Deadline"):  # still running at the deadline
            c.infer("k3_unary", _unary(tg, input_ids=[5], max_tokens=1000, temperature=0.0), client_timeout=0.3)
        # without the abort it runs to its end (hundreds of tokens), finished by "stop" or "length"
        assert _metric(triton, aborted, until=lambda v: v > before) == before + 1
        ref = llm.generate([7], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
        r = c.infer("k3_unary", _unary(tg, input_ids=[7], max_tokens=3, temperature=0.0))
        assert r.as_numpy("output_ids")[0].tolist() == ref
    # the counters are the engine's: this model's generated tokens include the three just answered
    assert _metric(triton, 'k3_generation_tokens_total{model="k3_unary"}') >= 3


def test_a_stopped_engine_is_unavailable_and_its_gauge_drops(triton):
    """An engine that stops (its step failed) answers its request, and every later one, UNAVAILABLE (HTTP 503)
    naming the cause and the way back; Triton's metrics show k3_engine_alive 0 for that model, 1 for the others."""
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    with th.InferenceServerClient(f"127.0.0.1:{triton.ports[0]}") as c:
        for _ in range(2):  # the request in flight when it stopped, then one after
            with pytest.raises(InferenceServerException, match="injected step failure") as e:
                c.infer("k3_dies", _unary(th, input_ids=[1, 2], max_tokens=2))
            recover = "restart the server, or (--model-control-mode=explicit) unload then load"  # a load alone: no-op
            assert e.value.status() == "503" and recover in str(e.value)
        assert c.is_model_ready("k3")
    # the decoupled model's: the request in flight through its sender thread, one after from execute
    import tritonclient.grpc as tg

    for _ in range(2):
        q: queue.Queue = queue.Queue()
        with tg.InferenceServerClient(f"127.0.0.1:{triton.ports[1]}") as c:
            c.start_stream(callback=lambda result, error: q.put((result, error)))
            c.async_stream_infer("k3_dies_stream", _inputs(tg, input_ids=[1, 2], max_tokens=2, stream=True))
            res, err = q.get(timeout=60)
            c.stop_stream()
        # a stream's error carries no status code: its message names the cause and the way back
        assert res is None and "injected step failure" in str(err) and recover in str(err), err
    assert _metric(triton, 'k3_engine_alive{model="k3_dies_stream"}', until=lambda v: v == 0) == 0
    # the gauge drops once the engine thread has ended (its watcher sets it), maybe a moment after the answers
    assert _metric(triton, 'k3_engine_alive{model="k3_dies"}', until=lambda v: v == 0) == 0
    metrics = _metrics_text(triton)
    alive = dict(re.findall(r'^k3_engine_alive\{model="(\w+)"\} (\S+)$', metrics, re.M))
    assert alive == {"k3": "1", "k3_unary": "1", "k3_gated": "1", "k3_ids_only": "1", "k3_ids_only_stream": "1",
                     "k3_dies": "0", "k3_dies_stream": "0"}, alive


def _final(res) -> bool:
    return res.get_response().parameters["triton_final_response"].bool_param


def test_engine_thread_does_not_wait_for_responses(triton, llm):
    """The engine thread only queues responses; a thread of the model's own sends them. With k3_gated's sends held
    back, the engine finishes 12 streamed requests (more than its 8 KDA slots) before any response has gone out;
    once they may go, every stream gets all its tokens in order, the last response final. The tokens that waited
    went out together: a response for all but the one the sender held at the gate."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[3 + i, 14, 15, 92][: 1 + i % 4] for i in range(12)]
    refs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    finished = 'k3_requests_finished_total{finish_reason="length",model="k3_gated"}'
    before = _metric(triton, finished)
    arrived = []
    reqs = [dict(input_ids=p, max_tokens=6, temperature=0.0, ignore_eos=True, stream=True) for p in prompts]
    _gate(triton).unlink()
    with ThreadPoolExecutor(1) as pool:
        streams = pool.submit(_stream, f"127.0.0.1:{triton.ports[1]}", "k3_gated", reqs, arrived.append)
        try:  # sending on the engine thread, it would wait for the gate at its first token
            done = _metric(triton, finished, deadline_s=60, until=lambda v: v == before + len(prompts))
            sent = len(arrived)
        finally:
            _gate(triton).touch()
        out = streams.result()
    assert (done - before, sent) == (len(prompts), 0)
    for ref, resps in zip(refs, out):
        assert [t for r in resps for t in _ids(r)] == ref.token_ids
        assert [_final(r) for r in resps] == [False] * (len(resps) - 1) + [True]
        assert resps[-1].as_numpy("finish_reason")[0].decode() == "length"
    # one stream's first token was in the send held at the gate; every other stream's 6 waited together. (The
    # engine counts a request finished just before it queues the last token: a stall there may split one more.)
    counts = sorted(len(resps) for resps in out)
    assert max(counts) <= 3 and sum(counts) <= len(prompts) + 2, counts


def test_stream_cancelled_by_its_client_is_aborted(triton, llm):
    """A gRPC client that cancels its stream has its request aborted on the engine (counted as finished by "abort"),
    the responses the engine made meanwhile dropped; the model answers the next request."""
    import tritonclient.grpc as tg

    url = f"127.0.0.1:{triton.ports[1]}"
    aborted = 'k3_requests_finished_total{finish_reason="abort",model="k3_gated"}'
    before = _metric(triton, aborted)
    q: queue.Queue = queue.Queue()
    c = tg.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer("k3_gated", _inputs(tg, input_ids=[5], max_tokens=1000, temperature=0.0, ignore_eos=True,
                                             stream=True))
    for _ in range(3):
        res, err = q.get(timeout=60)
        assert err is None and not _final(res)
    c.stop_stream(cancel_requests=True)
    c.close()
    # without the abort it runs to its end (1000 tokens), finished by "length"
    assert _metric(triton, aborted, until=lambda v: v > before) == before + 1
    ref = llm.generate([7], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    (resps,) = _stream(url, "k3_gated", [dict(input_ids=[7], max_tokens=3, temperature=0.0)])
    assert [t for r in resps for t in _ids(r)] == ref and _final(resps[-1])


def test_unload_drops_the_models_metrics_and_a_load_brings_it_back(triton, tiny_engine):
    """Unloading a model (explicit model control) takes every metric of its own out of Triton's /metrics (the stub
    is killed after finalize; its families must be dropped there) and leaves the other models'; loading it again, the
    way back that a stopped engine's error names, starts a fresh engine: alive again, its cache's gauges back. Last
    in this module: it unloads k3_dies, whose engine stopped in an earlier test."""
    import tritonclient.http as th

    ours = re.compile(r'^k3_\w+\{[^}]*model="k3_dies"[^}]*\} ', re.M)
    assert ours.search(_metrics_text(triton)), "k3_dies has no metrics before its unload"
    with th.InferenceServerClient(f"127.0.0.1:{triton.ports[0]}") as c:
        c.unload_model("k3_dies")
        text = _metrics_text(triton, lambda t: not ours.search(t))
        assert not ours.search(text), ours.findall(text)
        assert not c.is_model_ready("k3_dies")
        # the other models keep theirs (k3_dies_stream's engine stopped too: its gauge still says so)
        assert re.search(r'^k3_engine_alive\{model="k3_dies_stream"\} 0$', text, re.M)
        assert re.search(r'^k3_kv_pages_total\{model="k3_unary"\} ', text, re.M)
        c.load_model("k3_dies")
        assert c.is_model_ready("k3_dies")
    plan = json.loads((tiny_engine / "config.json").read_text())["memory_plan"]
    assert _metric(triton, 'k3_engine_alive{model="k3_dies"}', until=lambda v: v == 1) == 1
    assert _metric(triton, 'k3_kv_pages_total{model="k3_dies"}', until=lambda v: v > 0) == plan["num_pages"]
