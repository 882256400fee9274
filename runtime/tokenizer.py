"""The engine's tokenizer (tokenizer.json via the `tokenizers` library), incremental detokenizing and stop strings."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


def _byte_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte a printable character, the printable bytes themselves and
    the others from U+0100 on, in byte order; character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_chars()


class TokenizerError(ValueError):
    """A tokenizer file of the engine that cannot be read or parsed; the message names the file."""


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as e:  # permissions, a directory in its place
        raise TokenizerError(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text ({e})") from None


class Tokenizer:
    def __init__(self, engine_dir: str | Path):
        """FileNotFoundError when the engine has no tokenizer.json; TokenizerError for one of its files that cannot
        be read or parsed."""
        engine_dir = Path(engine_dir)
        path = engine_dir / "tokenizer.json"
        try:
            text = _read_text(path)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"{path}: the engine has no tokenizer; pass token ids instead of text") from None
        try:
            self._tok = _HFTokenizer.from_str(text)
        except Exception as e:  # the library raises a bare Exception for a file it cannot parse
            raise TokenizerError(f"{path}: not a tokenizer the `tokenizers` library reads ({e})") from None
        # token_bytes' lookups: the added tokens' texts, and whether tokens are byte-level (a decoder of its own or
        # one of a sequence)
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        decoder = self._tok.decoder
        self._byte_level = decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode()
        self.config = _read_config(engine_dir / "tokenizer_config.json")
        template = engine_dir / "chat_template.jinja"
        self.chat_template = _read_text(template) if template.exists() else self.config.get("chat_template")
        # encode_chat's: the special tokens' spellings, a pattern matching them, a copy reading them as text
        self._specials: list[str] | None = None
        self._spelled: re.Pattern | None = None
        self._as_text: _HFTokenizer | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """ValueError for text that is not Unicode a tokenizer can take (a lone surrogate, which JSON's \\ud800
        escapes and Python strings can hold)."""
        _check_unicode(text)
        return self._tok.encode(text, add_special_tokens=self._add_bos).ids

    @property
    def _add_bos(self) -> bool:
        return bool(self.config.get("add_bos_token", False))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, opening: str = "") -> list[int]:
        """The chat template's prompt for `messages` (and `tools`, as transformers' apply_chat_template takes them),
        as token ids, where the client's text (every string of the messages and the tools: contents, names, tool
        calls' arguments, tools' descriptions) never becomes a special token: a client whose message spells
        `<|im_system|>` sends those characters, not a turn of its own. The template's own special tokens are what
        it renders. Each spelling is stood in for by one private-use character while the template renders (so its
        filters see the text as it is), then encoded as text; the tokens next to it may differ from encoding the
        message whole. opening: text the answer is made to start with (the server's, not a client's: its special
        tokens' spellings are those tokens), after the generation prompt."""
        check_chat_text(messages, tools)
        if self._specials is None:
            self._specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values() if t.special),
                                    key=len, reverse=True)  # the longest spelling first where two overlap
            self._spelled = re.compile("|".join(map(re.escape, self._specials)) or "(?!)")
        # The template renders its own BOS: the text is encoded without special tokens, as transformers'
        # apply_chat_template and vLLM encode it (add_bos_token would put a second BOS before the template's).
        if not any(self._spelled.search(s) for _, s in _paths([messages, tools])):  # the usual case
            text = self.apply_chat_template(messages, add_generation_prompt, tools) + opening
            return self._tok.encode(text, add_special_tokens=False).ids

        def stand_in(text: str) -> str:
            text = re.sub(_STAND_INS, "", text)  # (a message's own characters of that range are dropped)
            return self._spelled.sub(lambda m: chr(_STAND_IN + self._specials.index(m.group())), text)

        text = self.apply_chat_template(_map_strings(messages, stand_in), add_generation_prompt,
                                        _map_strings(tools, stand_in)) + opening
        if self._as_text is None:
            self._as_text = _HFTokenizer.from_str(self._tok.to_str())
            self._as_text.encode_special_tokens = True
        ids = []
        for i, part in enumerate(re.split(f"({_STAND_INS})", text)):  # the template's text, a stand-in, ...
            if i % 2:
                ids += self._as_text.encode(self._specials[ord(part) - _STAND_IN], add_special_tokens=False).ids
            elif part:
                ids += self._tok.encode(part, add_special_tokens=False).ids
        return ids

    def special_tokens(self) -> dict[int, str]:
        """The special tokens (what skip_special_tokens leaves out): id -> spelling."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a piece of a multi-byte character stays a piece): an added token's text; a
        byte-level BPE token's characters mapped back to the bytes they stand for; a SentencePiece token's text
        with its ▁ as spaces, or its byte (<0xNN>). ValueError for an id the tokenizer does not have."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the tokenizer's vocabulary")
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece's byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The template rendered as transformers' apply_chat_template (what vLLM serves) renders it: a sandbox (a
        checkpoint's template is untrusted code), trim_blocks and lstrip_blocks, undefined names falsy (a message's
        `tool_calls`: Kimi's template tests it), raise_exception, strftime_now and its tojson; `tools` as
        transformers passes a list of JSON-schema dicts (None: no tools)."""
        if not self.chat_template:
            raise ValueError("the engine's tokenizer has no chat template; use completions instead")
        # a special token as a string, or as transformers writes an AddedToken ({"content": ..., "lstrip": ...})
        special = {k: v.get("content") if isinstance(v, dict) else v for k, v in self.config.items()
                   if k.endswith("_token")}
        special = {k: v for k, v in special.items() if isinstance(v, str)}
        return _compiled_chat_template(self.chat_template).render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **special)


@functools.lru_cache(maxsize=8)
def _compiled_chat_template(source: str):
    """A chat template compiled once in transformers' chat template environment (utils/chat_template_utils.py,
    which caches its compiled templates too): each chat request renders it."""
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # jinja's escapes HTML
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f))
    return env.from_string(source)


# encode_chat: the stand-ins for special-token spellings in the client's text (Supplementary Private Use Area-A, one
# character a special token)
_STAND_IN = 0xF0000
_STAND_INS = "[\U000F0000-\U000FFFFD]"


def _paths(x, where: str = ""):
    """(where, string) for every string in nested lists and dicts (keys too: a tool's JSON schema names its
    properties), where its place is: "[1].content", "[0].function.name"."""
    if isinstance(x, str):
        yield where, x
    elif isinstance(x, dict):
        for k, v in x.items():
            at = f"{where}.{k}" if isinstance(k, str) and k.isidentifier() else f"{where}[{k!r}]"  # (repr: escaped)
            if isinstance(k, str):
                yield f"{at} (a key)", k
            yield from _paths(v, at)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _paths(v, f"{where}[{i}]")


class ChatTextError(ValueError):
    """A string of a chat's messages or tools that no tokenizer takes: root ("messages" or "tools"), where in it
    ("[1].content"), and why (the character and its place in that string)."""

    def __init__(self, root: str, where: str, why: str):
        super().__init__(f"{root}{where}: {why}")
        self.root, self.where, self.why = root, where, why


def check_chat_text(messages, tools=None) -> None:
    """ChatTextError naming the first string of the messages or tools (as the client wrote them: a text part is
    named apart from the others) that no tokenizer takes."""
    for root, x in (("messages", messages), ("tools", tools)):
        for where, text in _paths(x):
            try:
                _check_unicode(text)
            except ValueError as e:
                raise ChatTextError(root, where, str(e)) from None


def _map_strings(x, f):
    """x with f applied to every string in it (_paths')."""
    if isinstance(x, str):
        return f(x)
    if isinstance(x, dict):
        return {_map_strings(k, f): _map_strings(v, f) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_map_strings(v, f) for v in x]
    return x


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: a lone surrogate {text[e.start]!r} at character {e.start}") \
            from None


def _read_config(path: Path) -> dict:
    """tokenizer_config.json's settings ({} when there is none)."""
    if not path.exists():
        return {}
    try:
        config = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def load_tokenizer(engine_dir: str | os.PathLike) -> Tokenizer | None:
    """The engine's tokenizer, None when it has none (tokenizer.json); TokenizerError for a file of it that cannot
    be read or parsed. Callers load it before the weights, so a damaged file costs no weight reading."""
    try:
        return Tokenizer(engine_dir)
    except FileNotFoundError:
        return None


def resolve_tokenizer(tokenizer, engine_dir: str | os.PathLike) -> Tokenizer | None:
    """The `tokenizer` argument of LLM and AsyncLLMEngine: "auto" (the engine dir's, None when it has none), None,
    a Tokenizer, or a directory holding tokenizer.json (as vLLM's `tokenizer=path`). Anything else is a ValueError
    naming the argument: a path string kept as the tokenizer failed later as "unknown encoding" or "no attribute
    'decode'", and another library's tokenizer object in the middle of a generation (no token_bytes)."""
    if isinstance(tokenizer, str) and tokenizer == "auto":
        return load_tokenizer(engine_dir)
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        if not (Path(tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: {os.fspath(tokenizer)!r} is not a directory holding tokenizer.json")
        return Tokenizer(tokenizer)
    raise ValueError("tokenizer: expected 'auto', None, a k3runtime Tokenizer or a directory holding tokenizer.json, "
                     f"got {type(tokenizer).__name__}")


class IncrementalText:
    """Text of a growing token list, decoding only the last few tokens at each step (vLLM's window).

    Decoding the whole list at every token costs O(n) a token: 0.6 ms a token 4K tokens in, on the tiny
    tokenizer, paid by the engine loop for every request between steps (tools/bench_detok.py). Instead two windows
    that start at the same token are decoded: up to the tokens already read, and up to the newest. What the longer adds is the new
    text; both start alike, so a decoder's rules for a text's first token (SentencePiece drops its leading space)
    cancel. A window that ends inside a multi-byte character (U+FFFD) is kept open until the character completes,
    or until the last token, whose text is taken as it is. Output that keeps ending in U+FFFD (invalid bytes, or
    literal U+FFFDs) keeps its window open, as in vLLM: nothing streams and each token decodes the whole window
    until a token ends in another character. Closing it early is not safe: a byte-fallback decoder turns a whole
    run of byte tokens into U+FFFDs while its last character is unfinished, so their count tells nothing.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read]
        self.prefix = self.read = 0  # the windows: ids[prefix:read] (already in text) and ids[prefix:]
        self._pending = ""  # the text of ids[read:] so far, an unfinished character at its end
        self._char = 0  # where that character starts in it

    def push(self, token_id: int, final: bool = False) -> int:
        """Add one token; return where its text starts (a token with a piece of a character starts at the
        character)."""
        self.ids.append(token_id)
        skip = self.skip_special_tokens
        done = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=skip)
        new = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=skip)[len(done):]
        common = 0
        if self._pending and self._continues(token_id):  # the character that the pending text ends with
            common = self._char
        elif self._pending:
            common = len(os.path.commonprefix([self._pending, new]))
        start = len(self.text) + common
        if final or (new and not new.endswith("\ufffd")):
            self.text, self._pending = self.text + new, ""
            self.prefix, self.read = self.read, len(self.ids)
        else:
            # the unfinished character (U+FFFD; one a byte with byte-fallback tokens) starts past this token's whole
            # characters, or the continued one's: not at an invalid byte's U+FFFD before them, text of its own
            self._pending, self._char = new, common + len(new[common:].rstrip("\ufffd"))
        return start

    def _continues(self, token_id: int) -> bool:
        """Whether the token's bytes begin with a UTF-8 continuation byte (10xxxxxx)."""
        try:
            raw = self.tokenizer.token_bytes(token_id)
        except ValueError:
            return False
        return bool(raw) and 0x80 <= raw[0] < 0xC0


class Detokenizer:
    """Text of a growing token list, released only as far as no stop string can still start there.

    The released prefix never changes afterwards, so streamed deltas concatenate to the final text.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0,
                 skip_special_tokens: bool = True):
        """min_tokens: stop strings are looked for only in text that ends past the first min_tokens tokens;
        skip_special_tokens: special tokens are left out of the text (False: kept, so stop strings can match them)."""
        self.stop, self.min_tokens, self._tokens = stop, min_tokens, 0
        self._hold = max((len(s) - 1 for s in stop), default=0)  # the longest tail that could begin one
        self._text = IncrementalText(tokenizer, skip_special_tokens)
        self._searched = 0  # stop strings were looked for in text[:_searched]
        self.released = 0
        self.text = ""
        # where the last token's text starts (IncrementalText.push); past the end of `text` for a token that
        # completed a stop string, since the text is cut before the stop string
        self.offset = 0
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that cut the text (the earliest; on a tie the first)

    def push(self, token_id: int, final: bool = False, stop_token: bool = False) -> str:
        """Add one token; return the newly released text (stop strings cut the text and set `stopped`).
        stop_token: the token ended the output itself (EOS, a stop id; final): as in vLLM, no stop string is looked
        for in its text, so the output ends by the id even where that text completes one (the text before it was
        searched already); its text stays, as any stop id's does."""
        final = final or stop_token
        self.offset = self._text.push(token_id, final)
        self._tokens += 1
        text = self._text.text  # whole characters only, unless final
        # Stop strings are looked for only where they could end in the new text; the earliest found cuts.
        found = [(at, s) for s in self.stop if (at := text.find(s, max(0, self._searched - len(s) + 1))) >= 0] \
            if self._tokens > self.min_tokens and not stop_token else []
        if found:
            at, self.stop_string = min(found, key=lambda f: f[0])
            text, self.stopped, final = text[:at], True, True
        self._searched = len(text)
        if not final and self._hold:  # hold back any tail that could begin a stop string
            text = text[:max(len(text) - self._hold, self.released)]
        delta = text[self.released:]
        self.released = len(text)
        self.text = text
        return delta
