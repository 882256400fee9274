"""Build engines from checkpoints for model tests (convert + build in one call)."""

from __future__ import annotations

from pathlib import Path


def build_engine(ckpt: Path, out: Path, *, mapping=None, quantize=None, **build_options) -> Path:
    """convert (default mapping: one rank) + build; returns the engine dir."""
    from k3build.build import BuildOptions, build
    from k3build.convert import convert
    from k3build.mapping import Mapping

    conv = out.with_name(out.name + "-converted")
    convert(ckpt, conv, mapping or Mapping(), quantize=quantize, overwrite=True)
    opts = {"dtype": "fp32", "kv_dtype": "fp32", "max_seq_len": 512, "max_num_tokens": 512, **build_options}
    return build(conv, out, BuildOptions(**opts), overwrite=True, progress=False)


def run_staggered(engine, prompts: list[list[int]], params, *, first: int = 4, later_at: int = 3):
    """Requests arriving over time, so that steps mix prefill chunks with decodes: the first `first` prompts at
    once, the rest before step `later_at`; steps until none is left. Returns ({prompt index: tokens}, {request id:
    prompt index})."""
    ids, out = {}, {}
    for i, p in enumerate(prompts[:first]):
        ids[engine.add_request(p, params).request_id] = i
    for step in range(300):
        if step == later_at:
            for i, p in enumerate(prompts[first:], start=first):
                ids[engine.add_request(p, params).request_id] = i
        for ev in engine.step():
            out.setdefault(ids[ev.request_id], []).append(ev.token_id)
        if step > later_at and not engine.has_unfinished():
            break
    return out, ids
