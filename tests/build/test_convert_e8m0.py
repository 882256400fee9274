"""MXFP4 block scales stored as F8_E8M0 (torch.float8_e8m0fnu) rather than U8: the same E8M0 bytes, so convert and
build give what the U8 checkpoint gives, byte for byte; every other dtype check stands."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from convert_helpers import copy_ckpt, make_tiny, rewrite_shard
from k3build.build import BuildOptions, build
from k3build.cli import main
from k3build.convert import convert
from k3build.mapping import Mapping

E8M0 = "F8_E8M0"
EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.1.w3."
SCALE, PACKED = EXPERT + "weight_scale", EXPERT + "weight_packed"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "ckpt")


def _set_scale_dtype(ckpt: Path, dtype: str) -> None:
    """Relabel every weight_scale in the shards' headers as `dtype`, padding each header to the length it has with
    F8_E8M0 and keeping the shards' modification time: both variants then have one size and mtime, which is what
    convert's conversion id hashes, so their outputs can be compared byte for byte."""
    for f in sorted(ckpt.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        scales = [k for k in header if k.endswith(".weight_scale")]
        longest = json.dumps({**header, **{k: {**header[k], "dtype": E8M0} for k in scales}}).encode()
        for k in scales:
            header[k]["dtype"] = dtype
        size = len(longest) + -len(longest) % 8
        f.write_bytes(struct.pack("<Q", size) + json.dumps(header).encode().ljust(size) + raw[8 + n:])
        os.utime(f, ns=(1_700_000_000_000_000_000,) * 2)


def _files(out: Path) -> dict[str, bytes]:
    """Every file under `out`; an engine's random build id (config stamp, weights header, graph) and the digests of
    the files holding it masked, so two builds of the same bytes compare equal."""
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    if "build_config" in (cfg := json.loads(files["config.json"])):
        build_id = cfg["stamp"]["build_id"].encode()
        for rank in cfg["ranks"].values():
            rank["weights_sha256"] = rank["graph_sha256"] = None
        files["config.json"] = json.dumps(cfg).encode()
        files = {k: v.replace(build_id, b"<build id>") for k, v in files.items()}
    return files


def test_e8m0_scales_give_the_u8_outputs(tiny, tmp_path):
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    options = BuildOptions(dtype="fp32", kv_dtype="fp32", max_seq_len=512, max_num_tokens=512)
    results = {}
    for dtype in ("U8", E8M0):
        _set_scale_dtype(ckpt, dtype)
        shard = ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][SCALE]
        with safe_open(str(shard), "pt") as f:  # a real F8_E8M0 checkpoint, as torch reads it
            assert f.get_tensor(SCALE).dtype == (torch.uint8 if dtype == "U8" else torch.float8_e8m0fnu)
        conv = convert(ckpt, tmp_path / "conv", Mapping(tp_size=2, moe_ep_size=2), overwrite=True, progress=False)
        dequantized = convert(ckpt, tmp_path / "bf16", Mapping(), quantize="none", overwrite=True, progress=False)
        engine = build(conv, tmp_path / "engine", options, overwrite=True, progress=False)
        results[dtype] = [_files(d) for d in (conv, dequantized, engine)]
    for what, u8, e8m0 in zip(("converted", "dequantized", "engine"), *results.values()):
        assert u8.keys() == e8m0.keys(), what
        for name in u8:
            assert u8[name] == e8m0[name], (what, name)
    with safe_open(str(tmp_path / "conv" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor(SCALE[len("language_model."):]).dtype == torch.uint8


def _refused(ckpt: Path, out: Path) -> str:
    r = CliRunner().invoke(main, ["convert", str(ckpt), str(out)])
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert not out.exists()
    return r.output


def _as_e8m0(name: str, byte: int | None = None):
    def edit(d):
        t = d[name].clone()
        if byte is not None:
            t.view(-1)[9] = byte
        d[name] = t.view(torch.float8_e8m0fnu)
        return d
    return edit


@pytest.mark.parametrize("target, edit, words", [
    (PACKED, _as_e8m0(PACKED), [f"{PACKED}: wrong dtype F8_E8M0, expected U8\n"]),
    (SCALE, lambda d: {**d, SCALE: d[SCALE].view(torch.int8)},
     [f"{SCALE}: wrong dtype I8, expected U8 or F8_E8M0 (the E8M0 bytes of MXFP4 block scales)"]),
    (SCALE, _as_e8m0(SCALE, 0xFF), [SCALE, "scale byte 0xFF (NaN in E8M0) at index [4, 1]", "expected bytes 0..252"]),
    # the exponents stored unbiased in the U8 bytes (2^-7 as 0xF9): every byte decodes finite, to weights near 2^120
    (SCALE, lambda d: {**d, SCALE: ((d[SCALE].to(torch.int16) - 127) & 0xFF).to(torch.uint8)},
     [SCALE, "the median block scale is 2^1", "are the exponents stored unbiased (signed)?"]),
], ids=["packed-e8m0", "scale-i8", "e8m0-nan", "signed-exponents"])
def test_other_dtypes_and_bad_e8m0_bytes_are_refused(tiny, tmp_path, target, edit, words):
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    shard = rewrite_shard(ckpt, edit, target)
    msg = _refused(ckpt, tmp_path / "out")
    assert shard in msg, msg
    for w in words:
        assert w in msg, (w, msg)
