"""The engine's tokenizer (tokenizer.json via the `tokenizers` library), incremental detokenizing and stop strings."""

from __future__ import annotations

import json
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


class Tokenizer:
    def __init__(self, engine_dir: str | Path):
        engine_dir = Path(engine_dir)
        path = engine_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: the engine has no tokenizer; pass token ids instead of text")
        self._tok = _HFTokenizer.from_file(str(path))
        # token_bytes' lookups: the added tokens' texts, and whether tokens are byte-level (a decoder of its own or
        # one of a sequence)
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        decoder = self._tok.decoder
        self._byte_level = decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode()
        cfg_path = engine_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = engine_dir / "chat_template.jinja"
        self.chat_template = template.read_text() if template.exists() else self.config.get("chat_template")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=bool(self.config.get("add_bos_token", False))).ids

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("the engine's tokenizer has no chat template; use completions instead")
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        special = {k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)}
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                          **special)


class Detokenizer:
    """Text of a growing token list, released only as far as no stop string can still start there.

    Decoding the whole output each time keeps multi-byte characters split across tokens intact; the
    released prefix never changes afterwards, so streamed deltas concatenate to the final text.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.released = 0
        self.text = ""
        self.stopped = False

    def push(self, token_id: int, final: bool = False) -> str:
        """Add one token; return the newly released text (stop strings cut the text and set `stopped`)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                text, self.stopped, final = text[:at], True, True
        if not final:
            # Hold back an incomplete UTF-8 character and any tail that could begin a stop string.
            keep = len(text) - 1 if text.endswith("\ufffd") else len(text)
            hold = max((len(s) - 1 for s in self.stop), default=0)
            keep = min(keep, len(text) - hold) if hold else keep
            text = text[:max(keep, self.released)]
        delta = text[self.released:]
        self.released = len(text)
        self.text = text
        return delta
