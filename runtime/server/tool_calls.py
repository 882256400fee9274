"""Kimi's tool calls in a chat output, read as vLLM's `kimi_k2` tool parser reads them.

The model writes its calls after any text, in one section:
`<|tool_calls_section_begin|>` then, per call, `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>`
`{JSON arguments}<|tool_call_end|>`, then `<|tool_calls_section_end|>`. The call's id is the function id as written,
its name what follows the id's last "." (before ":IDX"), its arguments the text as written (JSON or not). The
markers are special tokens, which skip_special_tokens leaves out of the text: the request runs with them kept
(SpecialsOut leaves the other special tokens out again). A section that is cut or malformed is no call: its text
stays content. Text after the section is dropped, as vLLM drops it; with parallel_tool_calls false, so are the calls
after the first (vLLM's rule: the model is not stopped, its further calls are not given out).

tool_choice "required" or a named function is forced by the answer's opening (CallRules.opening): the prompt ends
with the section's and a call's markers (and the function's id and the arguments' marker when named), which the
model continues; it is not constrained decoding, so the arguments are the model's text, unchecked. A forced section
ends at the output's end or at the first text after a whole call that is not another call (the model's EOS, kept
with skip_special_tokens false); a named call cut inside its arguments is still the call, as vLLM's forced call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)
# the id: any prefix ending in "." ("functions."), the name (OpenAI's names hold no "." or ":"), ":" and an index
_ID = re.compile(r"(?:\S*\.)?([^.:\s]+):\d+")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict:
        """The message's `tool_calls` entry; with index, a streamed `delta.tool_calls` entry."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class CallRules:
    """How one request's output is read for calls. max_calls: how many are given out (None: all); opening: the text
    the answer was made to start with (a forced call), read before the output and never content; reason: the
    finish_reason of an answer with calls ("stop" for a named function, as OpenAI and vLLM answer a forced one);
    named: one named call is forced: its end marker ends the output (a stop id), and an output cut inside its
    arguments is still that call, its arguments as far as they came."""
    max_calls: int | None = None
    opening: str = ""
    reason: str = "tool_calls"
    named: bool = False

    @classmethod
    def of(cls, tool_choice, parallel_tool_calls: bool | None, past_calls: int) -> CallRules:
        """The rules of a request's tool_choice (validated: "auto", "required" or a function by name) and
        parallel_tool_calls; past_calls: the calls in its history (Kimi numbers calls across the conversation)."""
        one = 1 if parallel_tool_calls is False else None
        if tool_choice == "required":
            return cls(one, SECTION_BEGIN + CALL_BEGIN)
        if isinstance(tool_choice, dict):
            fid = f"functions.{tool_choice['function']['name']}:{past_calls}"
            return cls(1, SECTION_BEGIN + CALL_BEGIN + fid + ARGS_BEGIN, "stop", named=True)
        return cls(one)


def _call(body: str) -> ToolCall | None:
    """A call from the text between its begin and end markers; None when it is malformed."""
    head, sep, args = body.partition(ARGS_BEGIN)
    if not sep or any(m in head or m in args for m in MARKERS):
        return None
    m = _ID.fullmatch(head.strip())
    return None if m is None else ToolCall(head.strip(), m.group(1), args.strip())


def _partial(text: str, marker: str) -> int:
    """The length of the longest tail of text that begins marker (and is not all of it)."""
    return next((n for n in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-n:])), 0)


class ToolCallStream:
    """A choice's text, delta by delta: content until the section begins, then each call once its end marker came.

    A tail that could begin the section's marker is held back, so a marker split across deltas never reaches the
    content. At the end (finish) whatever was held back and given out as no call is content: a marker's beginning,
    or a section that was cut or malformed, from the end of the last call given out (from its marker when none was),
    never the rules' opening. A forced section ends after a whole call at the output's end or at text that is not
    another call; a named call cut inside its arguments is still the call (finish).
    """

    def __init__(self, rules: CallRules = CallRules()):
        self.rules = rules  # calls past max_calls are read (the section must still be well-formed), not given out
        self.text = ""
        self.sent = 0  # text[:sent] is given out, as content or as calls
        self.section: int | None = None  # where the section's marker starts
        self.at = 0  # inside the section: where the next call or the section's end is looked for
        self.calls: list[ToolCall] = []
        self.state = "content"  # then "section"; "done" once it ended well, "bad" when malformed
        self.floor = len(rules.opening)  # the text before it was not the model's: never content
        self.push(rules.opening)

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Add text; returns the content it releases and the calls it completes."""
        self.text += delta
        if self.state == "content":
            at = self.text.find(SECTION_BEGIN, self.sent)  # (text before sent holds no marker's beginning)
            if at < 0:
                end = len(self.text) - _partial(self.text, SECTION_BEGIN)
                content, self.sent = self.text[self.sent:end], end
                return content, []
            content, self.sent, self.section = self.text[self.sent:at], at, at
            self.at, self.state = at + len(SECTION_BEGIN), "section"
            return content, self._calls()
        return "", self._calls() if self.state == "section" else []

    def _calls(self) -> list[ToolCall]:
        new = []
        while True:
            rest = self.text[self.at:]
            body = rest.lstrip()
            if body.startswith(SECTION_END):
                self.state = "done" if self.calls else "bad"  # an empty section calls nothing: vLLM's failure too
                return new
            if body.startswith(CALL_BEGIN):
                end = body.find(CALL_END)
                if end < 0:
                    return new
                call = _call(body[len(CALL_BEGIN):end])
                if call is None:
                    self.state = "bad"
                    return new
                if self.rules.max_calls is None or len(self.calls) < self.rules.max_calls:
                    self.calls.append(call)
                    new.append(call)
                self.at = self.sent = self.at + len(rest) - len(body) + end + len(CALL_END)
                continue
            if not (CALL_BEGIN.startswith(body) or SECTION_END.startswith(body)):  # neither, nor their beginning
                self.state = "done" if self.rules.opening and self.calls else "bad"  # (a forced section ends)
            return new

    @property
    def complete(self) -> bool:
        """Whether a whole, well-formed section with at least one call was read."""
        return self.state == "done"

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The output ended: the held-back text that is content after all ("" after a section that ended well), and
        a named call cut inside its arguments."""
        new = []
        if self.rules.opening and self.state == "section":
            body = self.text[self.at:].lstrip()
            if self.rules.named and not self.calls and (call := _call(body[len(CALL_BEGIN):])) is not None:
                self.calls.append(call)
                new.append(call)
            if self.calls and (new or not body):
                self.state = "done"
        if self.complete:
            return "", new
        content, self.sent = self.text[max(self.sent, self.floor):], len(self.text)
        return content, new


def parse_tool_calls(text: str, rules: CallRules = CallRules()) -> tuple[str | None, list[ToolCall]]:
    """A whole output's (content, calls): the text before the section (None if empty) and its calls (the first
    max_calls) when the section is whole and well-formed; else (the whole text, no calls)."""
    stream = ToolCallStream(rules)
    stream.push(text)
    stream.finish()  # (a forced section the output's end closes)
    if not stream.complete:
        return text, []
    return stream.text[stream.floor:stream.section] or None, stream.calls


class ToolDeltas:
    """A streamed choice's chat deltas when its output is read for tool calls: content until the section begins,
    then each call (a `delta.tool_calls` entry) once its end marker came; the last chunk's finish_reason
    "tool_calls" (the rules' reason) after a whole section (unless the output was cut by length)."""

    def __init__(self, text: SpecialsOut, rules: CallRules = CallRules()):
        self.text, self.calls, self.rules = text, ToolCallStream(rules), rules

    def push(self, token_id: int, text_offset: int | None, text: str, finish_reason: str | None
             ) -> tuple[dict, str | None]:
        """A token's chunk (StreamChunk's fields) -> its (delta, finish_reason)."""
        content, calls = self.calls.push(self.text.push(token_id, text_offset, text))
        if finish_reason is not None:
            more, cut = self.calls.finish()
            content, calls = content + more, calls + cut
            if self.calls.complete and finish_reason != "length":
                finish_reason = self.rules.reason
        delta = {"content": content} if content or (finish_reason is None and not calls) else {}
        if calls:
            first = len(self.calls.calls) - len(calls)
            delta["tool_calls"] = [call.to_openai(first + k) for k, call in enumerate(calls)]
        return delta, finish_reason


class SpecialsOut:
    """A choice's text from a request run with skip_special_tokens false, less the special tokens that `drop` names
    (id -> the length of its spelling): what skip_special_tokens would have left out but the tool-call markers.
    The engine says where each token's text starts (StreamChunk.text_offset), so a special token's spelling is cut
    where it stands, never a message's characters that happen to spell it."""

    def __init__(self, drop: dict[int, int]):
        self.drop = drop
        self.spans: list[tuple[int, int]] = []  # [start, end) of the dropped tokens' spellings not yet released
        self.at = 0  # how much of the text was released

    def push(self, token_id: int, text_offset: int | None, delta: str) -> str:
        """A token and the text the engine released with it; returns that text less the dropped spellings."""
        if token_id in self.drop and text_offset is not None:
            self.spans.append((text_offset, text_offset + self.drop[token_id]))
        start, end = self.at, self.at + len(delta)
        self.at = end
        kept, pos = [], start
        for a, b in self.spans:
            if a < end and b > pos:
                kept.append(delta[pos - start:max(a, pos) - start])
                pos = min(b, end)
        kept.append(delta[pos - start:])
        self.spans = [s for s in self.spans if s[1] > end]
        return "".join(kept)
