"""Per-request sampling options: a frozen, validated value object (no torch).

Reproducibility contract with the sampler: the random draw for output token i of a request is a
pure function of (`Request.sampling_seed`, i), where i = `Request.num_output_tokens` when the item
that samples it is scheduled. Preemption by recompute re-prefills prompt + generated tokens and
samples token i again with the same (seed, i), so the output is identical to an unpreempted run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# One request may not ask for more output tokens than K3's native context (1M tokens).
MAX_TOKENS_LIMIT = 1 << 20
SEED_LIMIT = 1 << 63
MAX_LOGPROBS = 20  # alternatives a token at most (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)
MAX_N = 64  # choices a prompt at most (each is a request of its own)
# the fields whose defaults an engine takes from its model's generation_config.json (LLMEngine.sampling_defaults):
# where a request gives none, the API, the servers and `generate` use those, as vLLM's generation_config="auto"
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens and when to stop.

    Args:
        max_tokens: output tokens to generate at most, 1..MAX_TOKENS_LIMIT.
        min_tokens: output tokens before EOS, stop_token_ids or a stop string may end the output (0..max_tokens):
            until then their logits are -inf and stop strings are not looked for.
        temperature: 0 = greedy (so is anything under sampler.MIN_TEMPERATURE, 1e-5); above, divides the logits.
        top_p: nucleus mass in (0, 1]; 1 = off.
        min_p: in [0, 1]; 0 = off. Tokens whose probability (after temperature) is below min_p times the most
            likely token's are dropped (vLLM's min_p; as in its V1 sampler, before top-k and top-p).
        top_k: keep the k most likely tokens (ties at the k-th broken by lower token id); 0 = off (-1 too, as in vLLM
            and the OpenAI server; stored as 0).
        seed: per-request seed in [0, 2**63); None = a random seed fixed at request creation.
        stop: strings that end generation (matched on detokenized text by the API layer, which needs a
            tokenizer); the text is cut before the first one. With skip_special_tokens a stop string that spells
            a special token never matches (the text leaves it out): give its id in stop_token_ids. A token that ends
            the output itself (EOS, a stop id) ends it by its id, as in vLLM, even where its text completes a stop
            string.
        stop_token_ids: token ids that end generation (applied by the scheduler, even with ignore_eos); the
            token and its text stay in the output (vLLM leaves the text out).
        ignore_eos: keep generating past the model's EOS token.
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the output's text (vLLM's default);
            False keeps them as the tokenizer spells them, the EOS that ends the output too (vLLM leaves that one
            out, as it does a stop id's text). Token ids and logprobs are the same either way.
        logprobs: return each output token's log-probability and its `logprobs` most likely alternatives
            (0..MAX_LOGPROBS; 0: the token's alone); None = none. See runtime/logprobs.py.
        prompt_logprobs: the same for the prompt's tokens, from its second (the first has nothing before it); they
            come with the request's first output token. None = none.
        presence_penalty: subtracted from the logit of every token already in the output, in [-2, 2]; 0 = off.
        frequency_penalty: subtracted from a token's logit once for each time it is in the output, in [-2, 2].
        repetition_penalty: divides the positive logits (multiplies the negative ones) of every token in the
            prompt or the output, > 0; 1 = off (CTRL's penalty, as transformers and vLLM apply it).
        logit_bias: {token id: bias in [-100, 100]} added to those logits before anything else (a sequence of
            (id, bias) pairs also works); token ids are checked against the vocabulary when the request is added.
        The four act before temperature, min-p, top-k and top-p, on greedy requests too; logprobs stay the model's raw
        ones. See runtime/penalties.py.
        n: choices for the prompt, 1..MAX_N: `LLM.generate` runs that many requests (`choices`), choice j seeded
            seed + j when a seed is given, else each its own random seed. An engine's request is one choice (n 1).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1

    def __post_init__(self):
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: expected an int in 1..{MAX_N} (choices for the prompt), got {self.n!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens: expected an int in 1..{MAX_TOKENS_LIMIT}, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: expected an int in 0..max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected a number in [0, 1] (0 = off), got {self.min_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: expected an int >= 0 (0 or -1 = off), got {self.top_k!r}")
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed: expected None or an int in [0, 2**63), got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: expected a string or a sequence of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) \
                or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected a sequence of ints >= 0, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name}: expected None or an int in 0..{MAX_LOGPROBS}, got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name}: expected a number in [-2, 2] (0 = off), got {v!r}")
            object.__setattr__(self, name, float(v))
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty: expected a finite number > 0 (1 = off), "
                             f"got {self.repetition_penalty!r}")
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        # Lists are accepted for convenience but stored as tuples so the object stays hashable.
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))

    def choices(self, n: int | None = None) -> list["SamplingParams"]:
        """The params of each of n choices (default self.n), one request each: choice j seeded seed + j when a seed
        is set (the same outputs as the OpenAI server's n), else each its own random seed."""
        n = self.n if n is None else n
        return [replace(self, n=1, seed=self.seed if self.seed is None else (self.seed + j) % SEED_LIMIT)
                for j in range(n)]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty counts the tokens seen so far (the scheduler then sends them with the item)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs sorted by id; ValueError names the bad entry."""
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(pairs, (tuple, list)) or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise ValueError(f"logit_bias: expected {{token id: bias}} or (id, bias) pairs, got {bias!r}")
    for t, b in pairs:
        if not _is_int(t) or t < 0:
            raise ValueError(f"logit_bias: token id {t!r}: expected an int >= 0")
        if not _is_number(b) or not -MAX_BIAS <= b <= MAX_BIAS:
            raise ValueError(f"logit_bias[{t}]: expected a number in [-100, 100], got {b!r}")
    ids = [t for t, _ in pairs]
    if len(set(ids)) < len(ids):
        raise ValueError(f"logit_bias: token id {next(t for t in ids if ids.count(t) > 1)} is given twice")
    return tuple(sorted((t, float(b)) for t, b in pairs))
