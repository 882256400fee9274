"""Tokens' logprobs (runtime/logprobs.py) in OpenAI's two shapes: the completions' columns and the chat's entries.

A token's text is its own bytes (Tokenizer.token_bytes) decoded, with U+FFFD for a piece of a multi-byte character;
chat entries also carry the bytes, which add up to the tokens' text with special tokens kept (the message's text
leaves those out unless skip_special_tokens is false, and a stop string cuts it). Without a tokenizer, or for an id
it does not have, the text is "token_id:N". Two alternatives of the same text share one key of a completions'
top_logprobs dict: the more likely stays. JSON has no infinities: a logprob of -inf (a token the model rules out) is
written -9999.0.
"""

from __future__ import annotations

import math

from ..logprobs import TokenLogprobs
from ..tokenizer import Detokenizer, Tokenizer

FLOOR = -9999.0  # what a -inf (or NaN) logprob is written as


def _finite(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


class TokenText:
    """Token id -> (text, bytes or None), remembered."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer, self.seen = tokenizer, {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        if token_id not in self.seen:
            try:
                raw = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else None
            except ValueError:  # an id past the tokenizer's vocabulary (a padded embedding)
                raw = None
            self.seen[token_id] = (f"token_id:{token_id}", None) if raw is None else \
                (raw.decode("utf-8", errors="replace"), list(raw))
        return self.seen[token_id]


class ChoiceOffsets:
    """A choice's text_offset, a token at a time: the engine's detokenizer's (StreamChunk.text_offset); without a
    tokenizer (no text), where each token starts in its `tokens` entries ("token_id:N") joined."""

    def __init__(self, text_of: TokenText):
        self.text_of, self.at = text_of, 0

    def push(self, token_id: int, text_offset: int | None) -> int:
        if text_offset is not None:
            return text_offset
        start, self.at = self.at, self.at + len(self.text_of(token_id)[0])
        return start


def completion_logprobs(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs | None], starts: list[int]
                        ) -> dict:
    """The completions' `logprobs` of tokens `ids` starting at `starts` in the choice's text (ChoiceOffsets):
    tokens, token_logprobs, top_logprobs (the most likely alternatives, and the token itself, as OpenAI does) and
    text_offset. A token without logprobs (an echoed prompt's first) has null ones."""
    tokens, top = [], []
    for t, lp in zip(ids, lps):
        tokens.append(text_of(t)[0])
        if lp is None:
            top.append(None)
            continue
        alternatives = {}
        for a, v in (*lp.top, (t, lp.logprob)):  # most likely first: it keeps a shared key
            alternatives.setdefault(text_of(a)[0], _finite(v))
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp.logprob) for lp in lps],
            "top_logprobs": top, "text_offset": starts}


def echoed_prompt(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs | None] | None,
                  skip_special_tokens: bool = True) -> tuple[str, dict | None, int]:
    """A completion's echoed prompt (`echo`): its text (the tokenizer's decoding of `ids`; "" without one), its
    `logprobs` columns when lps (the request's prompt_logprobs) is given, and how far the output's text_offsets
    move: the text's length, or without a tokenizer the length of the prompt's "token_id:N" names (ChoiceOffsets)."""
    offsets = ChoiceOffsets(text_of)
    if text_of.tokenizer is not None:
        det, starts = Detokenizer(text_of.tokenizer, skip_special_tokens=skip_special_tokens), []
        for i, t in enumerate(ids):
            det.push(t, final=i == len(ids) - 1)
            starts.append(det.offset)
        text, shift = det.text, len(det.text)
    else:
        starts = [offsets.push(t, None) for t in ids]
        text, shift = "", offsets.at
    return text, None if lps is None else completion_logprobs(text_of, ids, lps, starts), shift


def joined(prompt: dict, output: dict | None, shift: int) -> dict:
    """An echoed prompt's `logprobs` columns followed by its output's (whose text_offsets move by `shift`)."""
    if output is None:
        return prompt
    out = {k: prompt[k] + output[k] for k in ("tokens", "token_logprobs", "top_logprobs")}
    return {**out, "text_offset": prompt["text_offset"] + [s + shift for s in output["text_offset"]]}


def chat_logprobs(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs]) -> dict:
    """The chat completions' `logprobs`: {"content": an entry a token, with its top_logprobs}."""
    def entry(token_id: int, logprob: float) -> dict:
        text, raw = text_of(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": raw}
    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]}
                        for t, lp in zip(ids, lps)]}
