"""A small byte-level BPE tokenizer for synthetic checkpoints, trained in-process (no downloads).

Ids follow the config: pad/bos/eos sit at `cfg.pad_token_id`/`bos_token_id`/`eos_token_id`, chat markers and then
Kimi's tool-call markers take the lowest free ids, trained tokens fill the rest, and `<|reserved_N|>` fillers bring
the vocabulary to exactly `cfg.vocab_size`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .config import K3Config

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end_of_msg|>"
CHAT_MARKERS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>")
# Kimi's: an assistant's calls are one section of calls, each `<|tool_call_begin|>functions.NAME:IDX`
# `<|tool_call_argument_begin|>{JSON}<|tool_call_end|>` (k3runtime's server reads them back as vLLM's kimi_k2 parser)
TOOL_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>")
# As transformers renders it (trim_blocks: no newline may follow a block tag). Tools are declared in a system-like
# turn of their own, as JSON; a tool's result is a system-like turn naming the call it answers; a content left out
# or null renders as nothing. A call's arguments render as sent when a string, else as JSON (Kimi's template does
# the same: transformers' docs give them as a dict, which would otherwise render as Python's repr).
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|end_of_msg|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] in ('user', 'assistant') %}<|im_{{ m['role'] }}|>{% else %}<|im_system|>{% endif %}"
    "{{ m['role'] }}<|im_middle|>"
    "{% if m['role'] == 'tool' %}result of {{ m['tool_call_id'] }}: {% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}<|tool_calls_section_begin|>{% for c in m['tool_calls'] %}"
    "<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>{% set a = c['function']['arguments'] %}"
    "{% if a is string %}{{ a }}{% else %}{{ a | tojson }}{% endif %}<|tool_call_end|>"
    "{% endfor %}<|tool_calls_section_end|>{% endif %}"
    "<|end_of_msg|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
MAX_TRAINED = 4096  # merges learnable from the built-in text are far fewer anyway

_TEXT = """\
The quick brown fox jumps over the lazy dog while the engine counts tokens one by one.
A model reads text as numbers; a tokenizer turns words into pieces and pieces into ids.
Kimi attends to long contexts with linear attention layers and a few full attention layers.
Experts are chosen per token by a router, and only a handful of them run for each step.
Weights stored in four bits share one scale for every block of thirty-two values.
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Write a short poem about the sea. Assistant: Waves fold over waves, grey light on grey water.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 65536 3.14159 2.71828.
Code: def add(a, b):\\n    return a + b  # returns the sum; for i in range(10): print(i)
Symbols and punctuation: ( ) [ ] { } < > = + - * / % ! ? , . ; : ' " @ # $ & | ~ ^ _ \\\\
Mixed scripts help byte-level merges: café, naïve, über, 東京, Москва, 서울, مرحبا, 😀.
"""


def _special_ids(cfg: K3Config) -> dict[int, str]:
    fixed = {}
    for tok, i in ((PAD, cfg.pad_token_id), (BOS, cfg.bos_token_id), (EOS, cfg.eos_token_id)):
        if i is None:
            continue
        if not 0 <= i < cfg.vocab_size or i in fixed:
            raise ValueError(f"token id {i} for {tok}: must be unique and in 0..vocab_size-1={cfg.vocab_size - 1}")
        fixed[i] = tok
    free = (i for i in range(cfg.vocab_size) if i not in fixed)
    for tok in (*CHAT_MARKERS, *TOOL_MARKERS):
        fixed[next(free)] = tok
    return fixed


def build_tokenizer(cfg: K3Config) -> Tokenizer:
    """Byte-level BPE with exactly cfg.vocab_size ids and the config's special token ids."""
    specials = _special_ids(cfg)
    if cfg.vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size: {cfg.vocab_size} is too small for a byte-level tokenizer (>= {256 + len(specials)})")
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=min(cfg.vocab_size - len(specials), MAX_TRAINED),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    base.train_from_iterator([_TEXT] * 4, trainer=trainer)
    trained = json.loads(base.to_str())["model"]
    order = sorted(trained["vocab"].items(), key=lambda kv: kv[1])
    free = [i for i in range(cfg.vocab_size) if i not in specials]
    vocab = {tok: i for i, tok in specials.items()}
    for (tok, _), i in zip(order, free):
        vocab[tok] = i
    for n, i in enumerate(free[len(order):]):
        vocab[f"<|reserved_{n}|>"] = i
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    return tok


def write_tokenizer(out_dir: str | Path, cfg: K3Config) -> None:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) into out_dir."""
    out_dir = Path(out_dir)
    build_tokenizer(cfg).save(str(out_dir / "tokenizer.json"))
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS if cfg.bos_token_id is not None else None,
        "eos_token": EOS if cfg.eos_token_id is not None else None,
        "pad_token": PAD if cfg.pad_token_id is not None else None,
        "additional_special_tokens": [*CHAT_MARKERS, *TOOL_MARKERS],
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")


JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# What convert and build carry from the checkpoint into the engine. k3runtime reads tokenizer.json (and the JSON
# files); the others go along for other readers of the engine.
TOKENIZER_FILES = ("tokenizer.json", *JSON_FILES, "chat_template.jinja", "tokenizer.model", "tiktoken.model",
                   "vocab.json", "merges.txt")


def tokenizer_note(ckpt_dir: Path) -> str | None:
    """A warning when k3runtime will find no tokenizer.json in what is built from ckpt_dir (its engine then takes
    token ids only); None when it will."""
    if (ckpt_dir / "tokenizer.json").is_file():
        return None
    others = [n for n in TOKENIZER_FILES if (ckpt_dir / n).is_file() and n not in JSON_FILES]
    if not others:
        return (f"{ckpt_dir}: no tokenizer.json, nor another tokenizer file; the engine will take token ids only, "
                "not text")
    return (f"{ckpt_dir}: no tokenizer.json (only {', '.join(others)}), which is what k3runtime reads; the engine "
            "will take token ids only, not text, unless a tokenizer.json is put beside them (e.g. saved with "
            "transformers' AutoTokenizer.from_pretrained(...).save_pretrained(...))")


def check_tokenizer_files(ckpt_dir: Path, error: type[Exception]) -> None:
    """`error` naming a tokenizer file the runtime could not load (convert copies them into the engine, which would
    fail only at its first prompt): tokenizer.json as the tokenizers library reads it, the others as JSON."""
    path = ckpt_dir / "tokenizer.json"
    if path.is_file():
        try:
            Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception with serde's message
            raise error(f"{path}: not a tokenizer the runtime can load ({e})") from None
    for name in JSON_FILES:
        path = ckpt_dir / name
        if path.is_file():
            try:
                json.loads(path.read_text())
            except OSError as e:
                raise error(f"{path}: cannot read ({e.strerror})") from None
            except (ValueError, UnicodeDecodeError) as e:
                raise error(f"{path}: not valid JSON ({e})") from None
    # the other files are only copied, at the very end of a run: refuse an unreadable one now, not after hours
    for name in TOKENIZER_FILES:
        path = ckpt_dir / name
        if path.is_file() and not os.access(path, os.R_OK):
            raise error(f"{path}: cannot read (permission denied); convert copies it into the output")
