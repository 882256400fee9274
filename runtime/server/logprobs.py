"""Tokens' logprobs (runtime/logprobs.py) in OpenAI's two shapes: the completions' columns and the chat's entries.

A token's text is its own bytes decoded with U+FFFD for a piece of a multi-byte character (chat entries also carry
the bytes, which add up to the text); without a tokenizer it is "token_id:N". Two alternatives whose texts are the
same share one key of a completions' top_logprobs dict: the more likely stays.
"""

from __future__ import annotations

from ..logprobs import TokenLogprobs
from ..tokenizer import Tokenizer


class TokenText:
    """Token id -> (text, bytes), remembered."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer, self.seen = tokenizer, {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        if token_id not in self.seen:
            if self.tokenizer is None:
                self.seen[token_id] = (f"token_id:{token_id}", None)
            else:
                raw = self.tokenizer.token_bytes(token_id)
                self.seen[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self.seen[token_id]


def completion_logprobs(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs], offset: int = 0) -> dict:
    """The completions' `logprobs`: tokens, token_logprobs, top_logprobs and text_offset (each token's start in
    the choice's text as the tokens' texts add up, from `offset`)."""
    tokens, offsets = [], []
    for t in ids:
        offsets.append(offset)
        tokens.append(text_of(t)[0])
        offset += len(tokens[-1])
    top = [{} for _ in lps]
    for d, lp in zip(top, lps):
        for t, v in lp.top:  # most likely first: it keeps a shared key
            d.setdefault(text_of(t)[0], v)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(text_of: TokenText, ids: list[int], lps: list[TokenLogprobs]) -> dict:
    """The chat completions' `logprobs`: {"content": an entry a token, with its top_logprobs}."""
    def entry(token_id: int, logprob: float) -> dict:
        text, raw = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}
    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]}
                        for t, lp in zip(ids, lps)]}
