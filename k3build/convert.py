"""`k3build convert`: shard a K3 (MXFP4) or Kimi-Linear checkpoint into one safetensors file per rank.

Converted directory format (read by `k3build build`):
- `config.json`: `K3Config.to_dict()` of the output (model_type "k3"; `quantization` describes the output:
  method "mxfp4" = routed experts as `weight_packed`/`weight_scale` U8 (a source's F8_E8M0 scales, the same
  bytes, are written as U8), "none" = `weight` float), plus
  `"mapping"`: `Mapping.to_dict()`, `"source"`: {path, flavour ("k3"|"kimi_linear"), model_type,
  quantization, num_tensors} and `"format"`: "k3-converted/1". `K3Config.from_file` and `Mapping.from_dict`
  read it back.
- `rank{N}.safetensors` for N in range(world_size): exactly the tensors with `Mapping.shard(name, N, cfg)` not
  None, under canonical names (k3build/schema.py, "canonical"), each holding that rank's slice
  `narrow(dim, start, stop - start)` with `(start, stop) = Shard.bounds(full_shape[dim])` (dim None: whole).
  Header metadata: `k3_rank`, `k3_world_size`, `k3_conversion_id` (config.json's `conversion_id`: the files of
  one run), and `k3_slices` = JSON {name: {"shape": full canonical shape, "dim": int|null, "start": int,
  "stop": int}} so any reader can reassemble or check a tensor.
  Float tensors keep the source dtype (A_log is [H]: K3's zero padding is validated and dropped).
- Tokenizer and generation files of the source, copied unchanged (generation_config.json checked first:
  generation_config.py).
The directory appears atomically: it is written in a hidden staging dir next to OUT (output_dir.staged_output),
fsynced, renamed.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import click
import numpy as np
import torch
from k3plugins.progress import progress_bar

from . import __version__
from .command import writing_command
from .config import K3Config
from .convert_plan import (FORMAT, ConvertError, Job, Source, check_mapping, open_source, output_config,
                           plan_jobs)
from .finite import first_nonfinite
from .generation_config import read_generation_config
from .mapping import Mapping, MappingError, moe_tp_from_flags
from .mxfp4 import MXFP4Error, check_scale, dequantize_mxfp4, quantize_mxfp4
from .output_dir import check_free_space, check_output_dir, staged_output
from .safetensors_io import FileLayout, SafetensorsError, plan_file, pwrite_all, read_tensor, tensor_bytes
from .schema import SchemaError, to_canonical_tensor
from .tokenizer import TOKENIZER_FILES, check_tokenizer_files, tokenizer_note

# Test hook: seconds to sleep after each tensor, so a test can kill a run midway.
_SLEEP = float(os.environ.get("K3BUILD_CONVERT_TEST_SLEEP", "0") or 0)

__all__ = ["convert", "convert_cmd", "ConvertError"]


def _placements(jobs: list[Job], mapping: Mapping, cfg: K3Config, conversion_id: str):
    """Per rank the (name, dtype, slice shape) entries and per output the (rank, dim, start, stop) slices."""
    per_rank: list[list[tuple[str, str, tuple[int, ...]]]] = [[] for _ in range(mapping.world_size)]
    slices: list[dict] = [{} for _ in range(mapping.world_size)]
    where: dict[str, list[tuple[int, int | None, int, int]]] = {}
    for job in jobs:
        for out in job.outputs:
            for rank in range(mapping.world_size):
                shard = mapping.shard(out.name, rank, cfg)
                if shard is None:
                    continue
                shape = list(out.shape)
                dim = shard.dim if shard.parts > 1 else None
                start, stop = shard.bounds(shape[dim]) if dim is not None else (0, shape[0] if shape else 1)
                if dim is not None:
                    shape[dim] = stop - start
                per_rank[rank].append((out.name, out.dtype, tuple(shape)))
                slices[rank][out.name] = (out.shape, dim, start, stop)  # a tuple: ~500k tensors x ranks of them
                where.setdefault(out.name, []).append((rank, dim, start, stop))
    layouts = []
    # the model config the files were cut for: build refuses a config.json edited after convert (the id cannot tell)
    k3_config = json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":"))
    for r, entries in enumerate(per_rank):  # one rank's slices as JSON at a time
        json_slices = json.dumps({n: {"shape": list(shape), "dim": dim, "start": a, "stop": b}
                                  for n, (shape, dim, a, b) in slices[r].items()}, separators=(",", ":"))
        slices[r] = None
        layouts.append(plan_file(entries, {"format": "pt", "k3_rank": str(r), "k3_world_size": str(mapping.world_size),
                                           "k3_conversion_id": conversion_id, "k3_config": k3_config,
                                           "k3_slices": json_slices}))
    return layouts, where


# Per-process context of the job runner: config, source flavour, output paths, open file descriptors.
_STATE: dict = {}


def _check_finite(t: torch.Tensor, info) -> None:
    j = first_nonfinite(t)
    if j is not None:
        idx = [int(i) for i in np.unravel_index(j, tuple(t.shape))]
        raise ConvertError(f"{info.path}: tensor {info.name}: holds {float(t.reshape(-1)[j])} at index {idx}; "
                           "expected finite weights")


def _load(info) -> torch.Tensor:
    try:
        t = read_tensor(info)
    except SafetensorsError as e:
        raise ConvertError(str(e)) from None
    if t.is_floating_point():
        _check_finite(t, info)
    elif info.name.endswith("weight_scale"):
        try:
            check_scale(t, f"{info.path}: tensor {info.name}")
        except MXFP4Error as e:
            raise ConvertError(str(e)) from None
    return t


def _init_worker(cfg: K3Config, flavour: str, paths: list[Path]) -> None:
    _STATE.clear()
    _STATE.update(cfg=cfg, flavour=flavour, paths=paths, fds={})


def _run_job(task) -> int:
    """task = (job, {output name: [(rank, dim, start, stop, file offset)]})."""
    job, places = task
    st = _STATE
    if job.kind == "copy":
        t = _load(job.sources[0])
        try:
            src = job.sources[0]
            t = to_canonical_tensor(job.outputs[0].name, t, st["cfg"], st["flavour"], f"{src.path}: tensor {src.name}")
        except SchemaError as e:
            raise ConvertError(str(e)) from None
        results = [t]
    elif job.kind == "quantize":
        results = list(quantize_mxfp4(_load(job.sources[0])))
    else:
        # finite: _load refused scale bytes past mxfp4.E8M0_MAX_FINITE
        results = [dequantize_mxfp4(_load(job.sources[0]), _load(job.sources[1]), torch.bfloat16)]
    fds = st["fds"]
    for out, t in zip(job.outputs, results):
        t = t.reshape(out.shape)
        for rank, dim, start, stop, offset in places[out.name]:
            part = t if dim is None else t.narrow(dim, start, stop - start)
            if rank not in fds:
                fds[rank] = os.open(st["paths"][rank], os.O_WRONLY)
            pwrite_all(fds[rank], tensor_bytes(part), offset)
    if _SLEEP:
        time.sleep(_SLEEP)
    return job.nbytes


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _run_jobs(tasks: list) -> int:
    return sum(_run_job(task) for task in tasks)


def _execute(tasks: list, context: tuple, workers: int, progress: bool) -> None:
    tasks = sorted(tasks, key=lambda t: -t[0].nbytes)  # big first, so workers finish together
    bar = progress_bar(total=sum(t[0].nbytes for t in tasks), unit="B", unit_scale=True, desc="convert",
                       enabled=progress)
    try:
        if workers <= 1:
            _init_worker(*context)
            for task in tasks:
                bar.update(_run_job(task))
            return
        # forkserver: workers start from a clean single-threaded process (fork of a threaded torch can hang).
        # A process pool that notices a worker that died (the OOM killer's SIGKILL): multiprocessing.Pool starts
        # another and waits forever for the lost task, and its terminate() then hangs on the dead worker's lock.
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"),
                                   initializer=_init_worker, initargs=context)
        try:
            step = max(1, min(64, len(tasks) // (workers * 8)))
            futures = [pool.submit(_run_jobs, tasks[i:i + step]) for i in range(0, len(tasks), step)]
            for future in as_completed(futures):
                bar.update(future.result())
        except BaseException as e:  # a dead worker, a failed job, Ctrl-C: the jobs still running go too (their
            # output is being removed anyway); shutdown() alone would wait for them (Python 3.14's terminate_workers)
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
            if isinstance(e, BrokenProcessPool):
                raise ConvertError(f"a --workers process died mid-conversion (killed by a signal: the OOM killer, "
                                   f"say); nothing was written; with less memory, pass fewer --workers than "
                                   f"{workers}") from None
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        bar.close()
        for fd in _STATE.pop("fds", {}).values():
            os.close(fd)
        _STATE.clear()


def convert(ckpt_dir: str | Path, out_dir: str | Path, mapping: Mapping, *, quantize: str | None = None,
            workers: int = 1, overwrite: bool = False, progress: bool = True) -> Path:
    """Convert checkpoint `ckpt_dir` into the per-rank format above at `out_dir`.

    Args:
        quantize: None keeps the source's expert format; "mxfp4" quantizes float experts; "none" writes
            float experts (MXFP4 sources are dequantized to BF16).
        workers: processes moving tensors in parallel (each writes disjoint byte ranges). They start from a
            forkserver, so a script calling this with workers > 1 needs the `if __name__ == "__main__"` guard.
    Raises:
        ConvertError naming file, tensor and expectation; nothing is left at out_dir then.
    """
    out = Path(out_dir).absolute()
    if quantize not in (None, "none", "mxfp4"):
        raise ConvertError(f"--quantize: expected 'none' or 'mxfp4', got {quantize!r}")
    check_output_dir(out, Path(ckpt_dir), overwrite=overwrite, ours=lambda cfg: cfg.get("format") == FORMAT,
                     what="a converted checkpoint", error=ConvertError)
    # planning reads every shard's header and places every tensor: ~30 s for K3's 497k tensors before a byte moves
    with progress_bar(total=3, desc="plan (headers, jobs, slices)", unit="step", enabled=progress) as stage:
        src = open_source(ckpt_dir)
        check_tokenizer_files(src.path, ConvertError)
        cfg_out = output_config(src, quantize)
        read_generation_config(src.path, cfg_out.vocab_size, ConvertError)  # copied below; build reads it
        check_mapping(mapping, cfg_out)
        stage.update()
        jobs = plan_jobs(src, cfg_out)
        stage.update()
        conversion_id = _conversion_id(src, cfg_out, mapping)
        layouts, where = _placements(jobs, mapping, cfg_out, conversion_id)
        stage.update()
    check_free_space(out, sum(layout.size for layout in layouts), ConvertError)
    with staged_output(out, ConvertError) as tmp:
        paths = [tmp / f"rank{r}.safetensors" for r in range(mapping.world_size)]
        for path, layout in zip(paths, layouts):
            _write_header(path, layout)
        tasks = [(job, {o.name: [(r, dim, a, b, layouts[r].offsets[o.name]) for r, dim, a, b in where[o.name]]
                        for o in job.outputs}) for job in jobs]
        _execute(tasks, (src.cfg, src.flavour, paths), workers, progress)
        _write_config(tmp, src, cfg_out, mapping, conversion_id)
        for name in TOKENIZER_FILES:
            if (src.path / name).is_file():
                shutil.copyfile(src.path / name, tmp / name)
        for p in tmp.iterdir():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
    _fsync_dir(out.parent)
    return out


def _write_header(path: Path, layout: FileLayout) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, layout.size)
        pwrite_all(fd, layout.header, 0)
    finally:
        os.close(fd)


def _conversion_id(src: Source, cfg: K3Config, mapping: Mapping) -> str:
    """What ties the rank files to their config.json (build checks it): a hash of the source's files (path, size,
    modification time), the output config, the mapping and k3build's version. A rerun on the same files gives the
    same id and the same bytes; a conversion of another copy or version of the checkpoint, or by another k3build,
    gives another."""
    files = sorted({t.path for t in src.tensors.values()})
    stamp = [[os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files]
    blob = json.dumps([stamp, cfg.to_dict(), mapping.to_dict(), FORMAT, __version__], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _write_config(tmp: Path, src: Source, cfg: K3Config, mapping: Mapping, conversion_id: str) -> None:
    d = cfg.to_dict()
    d["mapping"] = mapping.to_dict()
    d["conversion_id"] = conversion_id
    d["source"] = {"path": str(src.path.absolute()), "flavour": src.flavour,
                   "model_type": src.raw_config.get("model_type"), "quantization": src.cfg.quantization.method,
                   "num_tensors": len(src.tensors)}
    d["format"] = FORMAT
    (tmp / "config.json").write_text(json.dumps(d, indent=2) + "\n")


@click.command("convert")
@click.argument("ckpt", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--tp-size", type=click.IntRange(min=1), default=None, help="ranks per PP stage [default: ep x moe-tp]")
@click.option("--ep-size", type=click.IntRange(min=1), default=None,
              help="expert-parallel ranks [default: tp / moe-tp]")
@click.option("--pp-size", type=click.IntRange(min=1), default=1, show_default=True, help="pipeline stages")
@click.option("--moe-tp-size", type=click.IntRange(min=1), default=None,
              help="ranks splitting each expert's intermediate dim [default: tp / ep given both, as plan; else 1]")
@click.option("--attention-dp", is_flag=True, help="replicate attention/dense weights; experts stay EP")
@click.option("--quantize", type=click.Choice(["none", "mxfp4"]), default=None,
              help="expert format of the output [default: as the source]")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="parallel processes")
@click.option("--overwrite", is_flag=True, help="replace an existing OUT")
@click.option("--progress/--no-progress", default=True, help="Show progress (in a log: a line every 30 s).")
def convert_cmd(ckpt, out, tp_size, ep_size, pp_size, moe_tp_size, attention_dp, quantize, workers, overwrite,
                progress):
    """Shard checkpoint CKPT into OUT/rank{N}.safetensors for the given mapping."""
    with writing_command("convert", out, (ConvertError, MappingError)):
        if moe_tp_size is None:  # as plan fills it in, so that plan's flags convert the same mapping
            moe_tp_size = moe_tp_from_flags(tp_size, ep_size)
        if tp_size is None:
            tp_size = (ep_size or 1) * moe_tp_size
        mapping = Mapping(tp_size=tp_size, pp_size=pp_size, moe_tp_size=moe_tp_size, moe_ep_size=ep_size,
                          attention_dp=attention_dp)
        path = convert(ckpt, out, mapping, quantize=quantize, workers=workers, overwrite=overwrite, progress=progress)
    click.echo(f"wrote {path} ({mapping.world_size} ranks)")
    note = tokenizer_note(Path(ckpt))  # the checkpoint, where a tokenizer.json would be put
    if note:
        click.echo(f"warning: {note}", err=True)
