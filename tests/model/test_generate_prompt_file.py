"""`k3runtime generate --prompt-file`: prompts from a JSONL file ({"prompt": ...} a line) or from stdin (-), after
any --prompt, each generated as a --prompt of it would be; a bad line is named by file and line number."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from k3runtime import LLM, SamplingParams
from k3runtime.cli import main

PROMPTS = ["Hello world", "two\nlines", "The quick brown fox"]


@pytest.fixture(scope="module")
def want(k3_tiny_engine):
    outs = LLM(k3_tiny_engine).generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    return [f"--- {p!r} -> {len(o.token_ids)} tokens ({o.finish_reason})\n{o.text}\n" for p, o in zip(PROMPTS, outs)]


def _jsonl(prompts) -> str:
    return "".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts))


def test_a_file_of_prompts(k3_tiny_engine, tmp_path, want):
    path = tmp_path / "prompts.jsonl"
    path.write_text(_jsonl(PROMPTS[1:]) + "\n")  # a blank line is skipped
    res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--max-tokens", "6", "--prompt", PROMPTS[0],
                                    "--prompt-file", str(path)])
    assert res.exit_code == 0, res.output
    assert res.stdout == "".join(want)


def test_prompts_from_stdin(k3_tiny_engine, want):
    r = subprocess.run([sys.executable, "-c", "from k3runtime.cli import main; main()", "generate",
                        str(k3_tiny_engine), "--max-tokens", "6", "--prompt-file", "-"],
                       input=_jsonl(PROMPTS), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "".join(want)


@pytest.mark.parametrize("text, expect", [
    ('{"prompt": "a"}\n{"prompt": "b"\n', "prompts.jsonl:2: not valid JSON"),
    ('{"prompt": "a"}\n"just text"\n', 'prompts.jsonl:2: expected an object with a "prompt" string, got "just text"'),
    ('{"text": "a"}\n', 'prompts.jsonl:1: expected an object with a "prompt" string'),
    ('{"prompt": 5}\n', 'prompts.jsonl:1: expected an object with a "prompt" string'),
    ("\n\n", "prompts.jsonl: no prompts in it"),
])
def test_a_bad_file_is_named_with_its_line(k3_tiny_engine, tmp_path, text, expect):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--prompt-file", str(path)])
    assert res.exit_code == 2 and expect in res.output, res.output


def test_a_prompt_the_engine_refuses_is_named_by_its_file_and_line(k3_tiny_engine, tmp_path):
    """A prompt of the file that the engine's prompt checks refuse (too long, empty) is named by the file and line it
    is on, a --prompt one by --prompt, before the engine loads."""
    max_len = json.loads((k3_tiny_engine / "config.json").read_text())["build_config"]["max_seq_len"]
    path = tmp_path / "prompts.jsonl"
    for bad, why in (("a " * max_len, f"tokens leave no room to generate under the engine's max_seq_len ({max_len})"),
                     ("", "empty (at least one token is needed)")):
        path.write_text(_jsonl(PROMPTS[:1]) + "\n" + _jsonl([bad]))  # line 3, after a blank one
        res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--prompt", PROMPTS[1],
                                        "--prompt-file", str(path)])
        assert res.exit_code == 1 and f"Error: --prompt-file {path}:3 (as tokens): " in res.output, res.output
        assert why in res.output and "--prompt (as tokens)" not in res.output, res.output
        res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--prompt", bad, "--prompt-file", str(path)])
        assert res.exit_code == 1 and "Error: --prompt (as tokens): " in res.output and why in res.output, res.output


def test_no_prompt_at_all_and_a_missing_file(k3_tiny_engine, tmp_path):
    res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine)])
    assert res.exit_code == 2 and "no prompts: give --prompt TEXT" in res.output, res.output
    res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--prompt-file", str(tmp_path / "none.jsonl")])
    assert res.exit_code == 2 and "none.jsonl" in res.output and "No such file" in res.output, res.output
    res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--stream", "--prompt-file", "-"],
                             input=_jsonl(PROMPTS[:2]))
    assert res.exit_code == 2 and "--stream prints one completion as it comes; got 2 prompts" in res.output


def test_a_file_with_a_bom_and_crlf(k3_tiny_engine, tmp_path, want):
    """A JSONL file saved by a Windows editor (UTF-8 with BOM, CRLF line ends) reads as the same prompts, from a file
    and from stdin."""
    data = "\ufeff".encode() + _jsonl(PROMPTS).replace("\n", "\r\n").encode()
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(data)
    res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--max-tokens", "6", "--prompt-file", str(path)])
    assert res.exit_code == 0, res.output
    assert res.stdout == "".join(want)
    r = subprocess.run([sys.executable, "-c", "from k3runtime.cli import main; main()", "generate",
                        str(k3_tiny_engine), "--max-tokens", "6", "--prompt-file", "-"],
                       input=data, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == "".join(want)


def test_n_completions_a_prompt(k3_tiny_engine):
    """`generate --n 2 --seed 5`: each prompt's two choices one after another, choice j the API's seed + j; a bad
    --n is refused by its flag."""
    res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--max-tokens", "5", "--temperature", "1.5",
                                    "--seed", "5", "--n", "2", "--prompt", PROMPTS[0], "--prompt", PROMPTS[2]])
    assert res.exit_code == 0, res.output
    llm = LLM(k3_tiny_engine)
    want = "".join(f"--- {p!r} [choice {j}] -> {len(o.token_ids)} tokens ({o.finish_reason})\n{o.text}\n"
                   for p in (PROMPTS[0], PROMPTS[2]) for j in range(2)
                   for o in llm.generate(p, SamplingParams(max_tokens=5, temperature=1.5, seed=5 + j)))
    assert res.stdout == want
    bad = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--n", "0", "--prompt", "hi"])
    assert bad.exit_code != 0 and "--n: expected an int in 1..64" in bad.output, bad.output


def test_max_tokens_past_max_seq_len_is_noted(k3_tiny_engine):
    """--max-tokens past the engine's max_seq_len (512 here): generated (an output would stop there) and said so on
    stderr (the server refuses such a request; the CLI ran it silently); within it, no note."""
    res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--max-tokens", "600",
                                    "--prompt", "Hello world"])
    assert res.exit_code == 0, res.output
    assert "note: --max-tokens 600 runs past the engine's max_seq_len 512" in res.output
    assert "--- 'Hello world' -> " in res.output
    short = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--max-tokens", "4", "--prompt", "Hello world"])
    assert short.exit_code == 0 and "note:" not in short.output


def test_out_of_range_numbers_are_usage_errors(k3_tiny_engine):
    """A negative --seed (generate) or --max-bytes (weight-store): click's range error naming the flag, exit 2,
    before anything loads (they reached the API's "expected None or an int" / a store allowing -0.00 GiB)."""
    res = CliRunner().invoke(main, ["generate", str(k3_tiny_engine), "--prompt", "hi", "--seed", "-1"])
    assert res.exit_code == 2 and "Invalid value for '--seed': -1 is not in the range" in res.output, res.output
    res = CliRunner().invoke(main, ["weight-store", str(k3_tiny_engine), "--max-bytes", "-1"])
    assert res.exit_code == 2 and "Invalid value for '--max-bytes': -1 is not in the range x>=1" in res.output, \
        res.output
