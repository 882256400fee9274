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
