"""Kimi's tool calls on /v1/chat/completions: the output parser on the synthetic tokenizer's real tokens, decoded a
token at a time as the engine streams them, and the real server with the `openai` client (requests with tools,
tool calls and tool results; a call the tiny model is steered into writing)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from k3build.config import preset
from k3build.tokenizer import write_tokenizer
from k3runtime.server.tool_calls import MARKERS, CallRules, SpecialsOut, ToolCallStream, ToolDeltas, parse_tool_calls
from k3runtime.tokenizer import Detokenizer, Tokenizer

MODEL = "k3-tiny"
SB, SE, CB, AB, CE = MARKERS
EOS = "<|end_of_msg|>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("synth_tokenizer")
    write_tokenizer(path, preset("tiny"))
    return Tokenizer(path)


def _ids(tok, *parts) -> list[int]:
    """Token ids: a marker (or EOS) by its special token's id, other text encoded."""
    specials = {s: i for i, s in tok.special_tokens().items()}
    return [i for p in parts for i in ([specials[p]] if p in specials else tok.encode(p))]


def _run(tok, ids, reason="stop", skip=True, stop=(), rules=CallRules()):
    """What the server sends for an output of `ids` when it reads tool calls: the request runs with special tokens
    kept (the engine's Detokenizer, a token at a time, as the engine streams), then the streamed deltas and finish
    reason (ToolDeltas), and the whole message's (content, calls) (parse_tool_calls of the same text)."""
    drop = {i: len(s) for i, s in tok.special_tokens().items() if s not in MARKERS} if skip else {}
    det, deltas, whole, out = Detokenizer(tok, stop, skip_special_tokens=False), ToolDeltas(SpecialsOut(drop), rules), \
        SpecialsOut(drop), None
    streamed, text = [], ""
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        released = det.push(t, final=last)
        text += whole.push(t, det.offset, released)
        delta, out = deltas.push(t, det.offset, released, reason if last else None)
        streamed.append(delta)
    return streamed, out, parse_tool_calls(text, rules)


def _content(streamed) -> str:
    return "".join(d.get("content", "") for d in streamed)


def _calls(streamed) -> list[dict]:
    return [c for d in streamed for c in d.get("tool_calls", ())]


def test_two_calls_after_content(tok):
    ids = _ids(tok, "Let me check.", SB, CB, "functions.get_weather:0", AB, '{"city": "Paris"}', CE,
               CB, "functions.get_time:1", AB, ' {"tz": "CET"} ', CE, SE, EOS)
    streamed, reason, (content, calls) = _run(tok, ids)
    want = [{"index": 0, "id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"index": 1, "id": "functions.get_time:1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]
    assert _content(streamed) == content == "Let me check." and reason == "tool_calls"
    assert _calls(streamed) == want and [c.to_openai(i) for i, c in enumerate(calls)] == want
    # each call comes in the chunk of its end marker's token, none before
    ends = [k for k, t in enumerate(ids) if t == _ids(tok, CE)[0]]
    assert [k for k, d in enumerate(streamed) if "tool_calls" in d] == ends
    assert all("<|" not in d.get("content", "") for d in streamed)


def test_parallel_tool_calls_false_gives_the_first_call_only(tok):
    """At most one call (parallel_tool_calls false): the second call is read but not given out, streamed or whole; a
    malformed second call still makes the section content, as with no limit."""
    two = [SB, CB, "functions.get_weather:0", AB, '{"city": "Paris"}', CE, CB, "functions.get_time:1", AB, "{}", CE]
    streamed, reason, (content, calls) = _run(tok, _ids(tok, "Hi", *two, SE, EOS), rules=CallRules(1))
    assert _content(streamed) == content == "Hi" and reason == "tool_calls"
    assert [c["id"] for c in _calls(streamed)] == [c.id for c in calls] == ["functions.get_weather:0"]
    bad = two[:-4] + ["get_time", AB, "{}", CE, SE]  # the second call's id lacks ":IDX"
    streamed, reason, (content, calls) = _run(tok, _ids(tok, *bad), rules=CallRules(1))
    assert calls == [] and reason == "stop" and SB in content


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_function_forced_by_the_opening(tok):
    """tool_choice naming a function: the answer starts with the call's markers, the id (numbered after the
    history's 2 calls) and the arguments' marker; the output is the arguments and the call's end marker (a stop id):
    one call, finish_reason "stop" (OpenAI's for a forced call). Cut by length inside the arguments: still the call,
    its arguments as far as they came (vLLM's forced call), no content."""
    rules = CallRules.of(NAMED, None, 2)
    assert rules.opening == f"{SB}{CB}functions.get_weather:2{AB}" and rules.named
    streamed, reason, (content, calls) = _run(tok, _ids(tok, '{"city": "Paris"}', CE), rules=rules)
    want = [{"index": 0, "id": "functions.get_weather:2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert _calls(streamed) == want and [calls[0].to_openai(0)] == want
    assert content is None and _content(streamed) == "" and reason == "stop"
    streamed, reason, (content, calls) = _run(tok, _ids(tok, '{"city": "Pa'), reason="length", rules=rules)
    cut = [{**want[0], "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]
    assert _calls(streamed) == cut and [calls[0].to_openai(0)] == cut and reason == "length"
    assert content is None and _content(streamed) == ""


@pytest.mark.parametrize("end, skip", [([SE, EOS], True), ([EOS], True), ([EOS], False), ([], True)],
                         ids=["section-closed", "eos", "eos-kept", "output-end"])
def test_required_forced_by_the_opening(tok, end, skip):
    """tool_choice "required": the answer starts with the section's and a call's markers; the model names the
    function. A forced section ends after a whole call at the output's end or at text that is not another call
    (the EOS, kept with skip_special_tokens false); output with no whole call is content (the model's text only)."""
    rules = CallRules.of("required", None, 0)
    assert rules.opening == SB + CB and not rules.named
    streamed, reason, (content, calls) = _run(tok, _ids(tok, "functions.get_time:0", AB, "{}", CE, *end),
                                              skip=skip, rules=rules)
    assert [c["function"]["name"] for c in _calls(streamed)] == [c.name for c in calls] == ["get_time"]
    assert content is None and _content(streamed) == "" and reason == "tool_calls"
    streamed, reason, (content, calls) = _run(tok, _ids(tok, "no call", EOS), rules=rules)
    assert calls == [] and content == _content(streamed) == "no call" and reason == "stop"


def test_no_content_and_non_json_arguments_kept_as_written(tok):
    ids = _ids(tok, SB, CB, "functions.add:0", AB, "a + b, not JSON {", CE, SE)
    streamed, reason, (content, calls) = _run(tok, ids)
    assert content is None and _content(streamed) == "" and reason == "tool_calls"
    assert [(c.id, c.name, c.arguments) for c in calls] == [("functions.add:0", "add", "a + b, not JSON {")]
    assert _calls(streamed)[0]["function"]["arguments"] == "a + b, not JSON {"


@pytest.mark.parametrize("body", [
    [CB, "functions.f:0", "{}", CE],  # no argument marker
    [CB, "functions.f", AB, "{}", CE],  # no :IDX
    [CB, "functions.f:0", AB, "{}", CE, "junk", CB, "functions.g:1", AB, "{}", CE],  # text between calls
    [CB, "functions.f:0", AB, "{}", CB, "functions.g:1", AB, "{}", CE],  # a call inside a call
    [],  # an empty section
], ids=["no-argument-marker", "no-index", "junk-between", "nested", "empty"])
def test_a_malformed_section_is_content(tok, body):
    """As vLLM on a parse failure: the whole text is the content, markers included (other special tokens left out,
    as the request asked), and the finish reason stays the engine's."""
    ids = _ids(tok, "Hi", "<|im_middle|>", " there", SB, *body, SE, EOS)
    text = "Hi there" + SB + tok.decode(_ids(tok, *body), skip_special_tokens=False) + SE
    streamed, reason, (content, calls) = _run(tok, ids)
    assert (content, calls) == (text, []) and reason == "stop"
    if "junk" in body:  # streamed, the call before the flaw came; the rest is content
        first_end = text.index(CE) + len(CE)
        assert [c["id"] for c in _calls(streamed)] == ["functions.f:0"]
        assert _content(streamed) == "Hi there" + text[first_end:]
    else:
        assert _content(streamed) == text and _calls(streamed) == []


def test_a_section_cut_by_length(tok):
    """Cut: no call from the whole message, its text is the content; streamed, the call that was whole came, the
    rest is content; the finish reason is length either way (also after a whole section)."""
    head = _ids(tok, "ok", SB, CB, "functions.f:0", AB, "{}", CE)
    ids = head + _ids(tok, CB, "functions.g:1", AB, '{"x": ')
    streamed, reason, (content, calls) = _run(tok, ids, reason="length")
    assert (content, calls) == (tok.decode(ids, skip_special_tokens=False), []) and reason == "length"
    assert [c["id"] for c in _calls(streamed)] == ["functions.f:0"]
    assert _content(streamed) == "ok" + tok.decode(ids[len(head):], skip_special_tokens=False)
    streamed, reason, (content, calls) = _run(tok, head + _ids(tok, SE), reason="length")
    assert [c.id for c in calls] == ["functions.f:0"] and reason == "length" and content == "ok"


def test_markers_split_across_deltas_never_reach_the_content(tok):
    """A stop string holds the text's tail back, so the engine releases a marker's spelling in two pieces; and any
    cut of the text into two deltas gives the same content and calls."""
    ids = _ids(tok, "Weather?", SB, CB, "functions.w:0", AB, "{}", CE, SE)
    streamed, reason, (content, calls) = _run(tok, ids, stop=("#" * 20,))  # holds 19 characters back
    assert _content(streamed) == content == "Weather?" and reason == "tool_calls" and len(_calls(streamed)) == 1
    text = tok.decode(ids, skip_special_tokens=False)
    for cut in range(len(text) + 1):
        s = ToolCallStream()
        (a, calls_a), (b, calls_b) = s.push(text[:cut]), s.push(text[cut:])
        assert a + b + s.finish()[0] == "Weather?" and [c.id for c in calls_a + calls_b] == ["functions.w:0"], cut
        assert a == text[:min(cut, len("Weather?"))], cut
    # a tail that only begins like the marker is content once the output ends
    s = ToolCallStream()
    assert s.push("so <|tool_calls") == ("so ", []) and s.finish() == ("<|tool_calls", [])


@pytest.mark.parametrize("stop", [(), ("#" * 20,)], ids=["", "held-back"])
def test_special_tokens_other_than_markers_follow_skip_special_tokens(tok, stop):
    """The text is decoded with special tokens kept; the others than the markers are cut where their tokens stand
    (skip_special_tokens true) or kept (false), never a message's characters that spell one; also where a stop
    string holds the text back, so a special token's spelling comes out tokens after it."""
    ids = _ids(tok, "a", "<|im_user|>", "b <|im", "_user|> c", SB, CB, "functions.f:0", AB, "{}", CE, SE, EOS)
    skipped = _run(tok, ids, stop=stop)
    assert skipped[2][0] == _content(skipped[0]) == tok.decode(ids[:ids.index(_ids(tok, SB)[0])]) == "ab <|im_user|> c"
    kept = _run(tok, ids, skip=False, stop=stop)
    assert kept[2][0] == _content(kept[0]) == "a<|im_user|>b <|im_user|> c"
    # without a section, the text is what skip_special_tokens gives
    plain = _ids(tok, "x", "<|im_middle|>", "y", EOS)
    streamed, _, whole = _run(tok, plain, stop=stop)
    assert whole == (tok.decode(plain), []) and _content(streamed) == "xy"


# --- the server ---

@pytest.fixture(scope="module")
def server(tiny_engine, make_server):
    """The session server's limits but the prompt's: the byte-level tiny tokenizer spells a tool's JSON schema in
    about a token a character."""
    s = make_server(tiny_engine, max_prompt_tokens=1024, max_tokens_limit=64)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]
HISTORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "functions.get_weather:0", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"}]


def test_tools_and_tool_messages_reach_the_prompt_as_transformers_renders_them(client, tiny_engine):
    """The oracle: transformers' apply_chat_template(messages, tools=tools) on the engine's tokenizer counts the
    prompt's tokens; tool_choice "none" renders the same prompt."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(tiny_engine)  # its tokenizer_file: the engine's tokenizer.json
    want = hf.apply_chat_template(HISTORY, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    no_tools = hf.apply_chat_template(HISTORY, add_generation_prompt=True, return_dict=False)
    assert len(want) > len(no_tools)
    for choice in ("auto", "none", None):
        r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=4, temperature=0,
                                           **({} if choice is None else {"tool_choice": choice}),
                                           parallel_tool_calls=True)
        assert r.usage.prompt_tokens == len(want) and r.choices[0].finish_reason in ("stop", "length"), choice
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(no_tools)


def test_a_streamed_request_with_tools_ends(client):
    """The tiny model writes no call by itself: its text comes as content, the stream ends with a finish reason,
    usage and [DONE] (the client's iteration ends), and equals the unary answer."""
    kw = dict(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert whole.message.tool_calls is None and whole.finish_reason == "length"


@pytest.mark.parametrize("change, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice",
     "tool_choice.function.name: 'get_date' is not among the tools (get_weather, get_time)"),
    ({"tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice",
     'tool_choice: expected {"type": "function", "function": {"name": ...}}'),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice: expected"),
    ({"tool_choice": "auto", "tools": None}, "tool_choice", "tool_choice: 'auto' needs tools"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "get time"}}]}, "tools",
     "tools[1].function.name: String should match pattern"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"description": "no name"}}]}, "tools",
     "tools[1].function.name: Field required"),
    ({"tools": [{"type": "retrieval", "function": TOOLS[0]["function"]}]}, "tools", "tools[0].type: Input should be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools",
     "tools[0].function.parameters: Input should be a valid dictionary"),
    ({"functions": [{"name": "f"}]}, "functions", "functions: deprecated by OpenAI and not supported; send tools"),
    ({"messages": HISTORY[:3] + [{"role": "tool", "content": "sunny"}]}, "messages",
     "messages[3].tool_call_id: required"),
    ({"messages": HISTORY[:2] + [{"role": "assistant"}]}, "messages", "messages[2].content: required"),
    ({"messages": HISTORY[:2] + [{**HISTORY[2], "tool_calls": [{"id": "x", "type": "function",
                                                                "function": {"name": "f", "arguments": {}}}]}]},
     "messages", "messages[2].tool_calls[0].function.arguments: Input should be a valid string"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "description": "ab\ud800"}}]}, "tools",
     "tools[1].function.description: not valid Unicode text: a lone surrogate '\\ud800' at character 2"),
    ({"messages": HISTORY[:3] + [{**HISTORY[3], "content": "\udfff"}]}, "messages",
     "messages[3].content: not valid Unicode text: a lone surrogate '\\udfff' at character 0"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"k\ud800": {}}}}}]},
     "tools", "tools[0].function.parameters.properties['k\\ud800'] (a key): not valid Unicode text"),
], ids=["unknown-function", "named-flat", "unknown-choice", "auto-without-tools", "bad-name", "no-name", "not-function", "parameters",
        "functions", "tool-without-id", "assistant-without-content", "arguments-not-a-string", "surrogate-in-tools",
        "surrogate-in-tool-result", "surrogate-in-a-key"])
def test_tool_requests_it_cannot_serve_are_400s_naming_the_field(server, change, param, words):
    body = {"model": MODEL, "messages": HISTORY, "tools": TOOLS, "max_tokens": 2, **change}
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body),  # (JSON's \\ud800 escapes)
                   headers={"content-type": "application/json"}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err


def _steered_call(llm, prompt: list[int], chain: list[int], penalty: float = 4.0) -> dict[str, float]:
    """A logit_bias that makes greedy decoding with presence_penalty 2 and frequency_penalty 2 (a token once in the
    output loses 4) write `chain` (distinct ids), from the engine's own logits along it: difference constraints
    bias[want] - bias[other] > logit[other] - logit[want] (plus the penalties, and a margin), step by step,
    solved by Bellman-Ford; every other token stays ~50 below."""
    logits = llm.logits(prompt + chain)
    edges = []  # (u, v, w): bias[v] <= bias[u] + w
    for k, want in enumerate(chain):
        row, used = logits[len(prompt) - 1 + k].tolist(), set(chain[:k])
        for other in (t for t in chain if t != want):
            gap = row[other] - row[want] - penalty * (other in used) + penalty * (want in used) + 0.2
            edges.append((want, other, -gap))
    bias = dict.fromkeys(chain, 0.0)
    for _ in range(len(chain) + 1):
        relaxed = [(v, bias[u] + w) for u, v, w in edges if bias[u] + w < bias[v] - 1e-9]
        if not relaxed:
            return {str(t): 50 + b for t, b in bias.items()}
        for v, b in relaxed:
            bias[v] = min(bias[v], b)
    raise AssertionError("no logit_bias makes the tiny model write the call (a negative cycle)")


def test_the_model_writes_a_call(client, llm):
    """The tiny model steered by logit_bias and penalties (real sampling, no stand-in) into Kimi's call:
    `<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>{}<|tool_call_end|>`
    `<|tool_calls_section_end|>` then EOS. Unary: a tool call, no content, finish_reason "tool_calls"; streamed, one
    delta.tool_calls entry; logprobs a token an entry as without tools; tool_choice "none": the text, no call."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "call f"}]
    prompt = llm.tokenizer.encode_chat(messages, True, tools)
    chain = _ids(llm.tokenizer, SB, CB, "f:0", AB, "{}", CE, SE, EOS)
    kw = dict(model=MODEL, messages=messages, tools=tools, max_tokens=16, temperature=0, presence_penalty=2,
              frequency_penalty=2, logit_bias=_steered_call(llm, prompt, chain))
    r = client.chat.completions.create(**kw, logprobs=True, extra_body={"return_token_ids": True}).choices[0]
    assert r.model_extra["token_ids"] == chain
    assert r.finish_reason == "tool_calls" and r.message.content is None
    assert [c.model_dump() for c in r.message.tool_calls] == [
        {"id": "f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert [bytes(e.bytes).decode() for e in r.logprobs.content] == [llm.tokenizer.decode([t], False) for t in chain]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True)]
    assert [c.finish_reason for c in chunks][-1] == "tool_calls" and not any(c.delta.content for c in chunks)
    calls = [t for c in chunks for t in c.delta.tool_calls or ()]
    assert [t.model_dump() for t in calls] == [{"index": 0, "id": "f:0", "type": "function",
                                                 "function": {"name": "f", "arguments": "{}"}}]
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert one.message.tool_calls == r.message.tool_calls and one.finish_reason == "tool_calls"
    plain = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == ("f:0{}", None, "stop")
    # the history a client sends back with the call and its result is taken
    back = messages + [r.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": "f:0",
                                                                  "content": json.dumps({"ok": True})}]
    assert client.chat.completions.create(**{**kw, "messages": back, "max_tokens": 1}).usage.prompt_tokens > len(prompt)


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call(client, llm, tiny_engine, choice):
    """tool_choice naming f, or "required": the prompt ends with the call's opening (its tokens as transformers
    encodes the rendered chat plus that text), the tiny model steered into the rest: `{}<|tool_call_end|>` (named:
    the end marker stops it), or `f:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>` and
    EOS (required). One call, unary and streamed; finish_reason "stop" named (as OpenAI's), "tool_calls" required.
    Unsteered and cut by length, the tiny model's text is the named call's arguments, or (required) the content
    without the opening's markers."""
    from transformers import PreTrainedTokenizerFast

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "call f"}]
    tool_choice = {"type": "function", "function": {"name": "f"}} if choice == "named" else "required"
    opening = CallRules.of(tool_choice, None, 0).opening
    prompt = llm.tokenizer.encode_chat(messages, True, tools, opening)
    hf = PreTrainedTokenizerFast.from_pretrained(tiny_engine)
    rendered = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert prompt == hf(rendered + opening, add_special_tokens=False)["input_ids"]
    rest = ["{}", CE] if choice == "named" else ["f:0", AB, "{}", CE, SE, EOS]
    chain = _ids(llm.tokenizer, *rest)
    kw = dict(model=MODEL, messages=messages, tools=tools, tool_choice=tool_choice, max_tokens=16, temperature=0,
              presence_penalty=2, frequency_penalty=2, logit_bias=_steered_call(llm, prompt, chain))
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    c, reason = r.choices[0], "stop" if choice == "named" else "tool_calls"
    assert r.usage.prompt_tokens == len(prompt) and c.model_extra["token_ids"] == chain
    want = {"id": "functions.f:0" if choice == "named" else "f:0", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}
    assert [t.model_dump() for t in c.message.tool_calls] == [want]
    assert c.message.content is None and c.finish_reason == reason
    assert c.model_extra["stop_reason"] is None  # (not the end marker the server made a stop id of)
    chunks = [ch.choices[0] for ch in client.chat.completions.create(**kw, stream=True)]
    assert [t.model_dump() for ch in chunks for t in ch.delta.tool_calls or ()] == [{"index": 0, **want}]
    assert chunks[-1].finish_reason == reason and not any(ch.delta.content for ch in chunks)
    assert chunks[-1].model_extra["stop_reason"] is None
    free_kw = {**kw, "logit_bias": None, "max_tokens": 8}
    free = client.chat.completions.create(**free_kw).choices[0]
    streamed = [ch.choices[0] for ch in client.chat.completions.create(**free_kw, stream=True)]
    assert free.finish_reason == streamed[-1].finish_reason == "length"
    if choice == "named":  # cut inside the arguments: still the call, its arguments as far as they came
        assert free.message.content is None and len(free.message.tool_calls) == 1
        assert [t.model_dump() for ch in streamed for t in ch.delta.tool_calls or ()] == [
            {"index": 0, **free.message.tool_calls[0].model_dump()}]
    else:
        assert free.message.tool_calls is None and not any(m in free.message.content for m in (SB, CB))
        assert "".join(ch.delta.content or "" for ch in streamed) == free.message.content


def test_a_named_call_is_numbered_after_the_history(client, tiny_engine):
    """Kimi numbers calls across the conversation: after HISTORY's one call, the forced id is
    functions.get_weather:1 (the prompt's ids, as transformers encodes the rendered chat plus the opening)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(tiny_engine)
    rendered = hf.apply_chat_template(HISTORY, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    want = hf(rendered + f"{SB}{CB}functions.get_weather:1{AB}", add_special_tokens=False)["input_ids"]
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=1, temperature=0,
                                       tool_choice=NAMED, extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == want


def test_a_tokenizer_without_the_markers_cannot_force_a_call(tiny_engine, make_server, tmp_path):
    """An engine whose tokenizer lacks a marker (the tiny engine's, its call end renamed): "required" and a named
    function are 400s naming tool_choice (their opening would be encoded as plain text); "auto" still serves."""
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    tok = json.loads((engine / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        if t["content"] == CE:
            t["content"] = "<|call_done|>"
    (engine / "tokenizer.json").write_text(json.dumps(tok))
    s = make_server(engine, max_prompt_tokens=1024, max_tokens_limit=64)
    try:
        body = {"model": MODEL, "messages": HISTORY[:2], "tools": TOOLS, "max_tokens": 2}
        for choice in ("required", NAMED):
            r = httpx.post(f"{s.url}/v1/chat/completions", json={**body, "tool_choice": choice}, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "tool_choice" and "no tool-call markers" in err["message"]
        assert httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        s.close()
