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


def prefill_step_batch(device):
    """An eager step's inputs: a fresh 6-token prompt (slot 0, page 0) beside one decode token of a 9-token
    sequence (slot 1, page 1), with the host's lengths (host_seqs) so that the MLA plugins may pick the prompt's
    un-absorbed form; logits of each sequence's last row."""
    import torch

    from k3runtime.executor import StepBatch
    t = lambda v: torch.tensor(v, device=device)  # noqa: E731
    return StepBatch(input_ids=t([5, 17, 99, 3, 250, 7, 8]), cu_seqlens=t([0, 6, 7]), slot_ids=t([0, 1]),
                     context_lens=t([6, 9]), page_table=t([[0, -1], [1, -1]]), logits_indices=t([5, 6]),
                     host_seqs=((6, 6), (1, 9)))
