"""Load one rank of an engine: verify its stamp, read its graph and weights (the runtime never needs k3build)."""

from __future__ import annotations

import hashlib
import json
import stat
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from k3plugins import registry
from k3plugins.moe.mxfp4 import E8M0_MAX_FINITE, W4_MAX_SCALE_BYTE, W4_TACTICS

from .dist import weight_store
from .engine_dir import check_engine_fields, no_config, not_an_engine
from .graph_check import graph_problem
from .graph_ops import ONNX_TO_TORCH
from .kv_cache.cache_tensors import CacheConfig
from .model_facts import ModelFacts
from .weight_reader import WeightFileError, read_header, read_weights

ENGINE_FORMAT_VERSION = 1


class EngineError(RuntimeError):
    """The engine cannot be loaded here; the message says what to rebuild or fix."""


@dataclass
class RankEngine:
    engine_dir: Path
    rank: int
    config: dict
    facts: ModelFacts
    graph: onnx.GraphProto
    weights: dict[str, torch.Tensor]

    @property
    def build(self) -> dict:
        return self.config["build_config"]

    @property
    def rank_info(self) -> dict:
        return self.config["ranks"][str(self.rank)]

    @property
    def world_size(self) -> int:
        return self.config["mapping"]["world_size"]

    def cache_config(self, *, num_pages: int, num_slots: int) -> CacheConfig:
        """This rank's cache geometry with these sizes."""
        return CacheConfig.for_rank(self.config, self.rank, num_pages=num_pages, num_slots=num_slots)

    def local_layers(self, kind: str) -> list[int]:
        start, stop = self.rank_info["layers"]
        return [i for i in range(start, stop) if self.facts.layer_types[i] == kind]


def read_engine_config(engine_dir: str | Path) -> dict:
    path = Path(engine_dir) / "config.json"
    try:
        _regular(path)
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise EngineError(no_config(engine_dir)) from None
    except OSError as e:
        raise EngineError(_unreadable(path, e)) from None
    except UnicodeDecodeError as e:
        raise EngineError(f"{path}: not valid JSON (not UTF-8 text: {e})") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineError(f"{path}: not valid JSON ({e})") from None
    check_stamp(cfg, path)
    return cfg


def _device_target(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if torch.version.hip:
        return "gfx942"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def _gpu_target(target) -> bool:
    return isinstance(target, str) and target.startswith(("sm", "gfx"))


def default_device(cfg: dict) -> str:
    """The device the CLIs run an engine on when --device is not given: its target's (cuda for an sm90 or gfx942
    engine: ROCm's torch names its GPUs cuda too; cpu for a cpu one)."""
    return "cuda" if _gpu_target(cfg.get("stamp", {}).get("target")) else "cpu"


def check_device_present(device: torch.device, path: Path, target: str | None = None) -> None:
    """Refuse a GPU device that torch cannot use here, before anything touches it (naming a GPU engine's target:
    its device may be the default, not a flag the user gave)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = "" if (torch.version.cuda or torch.version.hip) else ", a CPU-only build"
        gpu_engine = f"this {target} engine runs on " if _gpu_target(target) else ""
        raise EngineError(f"{path}: {gpu_engine}--device {device}: torch {torch.__version__}{build} sees no GPU here; "
                          "a cpu engine (`k3build build --target cpu`) runs with --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise EngineError(f"{path}: --device {device}: torch sees {torch.cuda.device_count()} GPU(s) here")


def check_device_kind(cfg: dict, path: Path, device: torch.device) -> None:
    """What the device's kind alone says on any host (no GPU needed to tell): a GPU engine refused on the cpu, a
    cpu engine on a GPU."""
    target = cfg["stamp"].get("target")
    if device.type == "cpu" and _gpu_target(target):
        raise EngineError(f"{path}: engine built for target {target!r} but this device is 'cpu'; run it on a GPU "
                          "with --device cuda (the CLIs' default for it; the Python API's is cpu), or rebuild "
                          "with `k3build build --target cpu`")
    if device.type != "cpu" and target == "cpu":
        raise EngineError(f"{path}: engine built for target 'cpu' but --device {device} is a GPU; run it with "
                          "--device cpu (the CLIs' default for it), or rebuild with `k3build build --target sm90` "
                          "(or gfx942)")


def check_stamp(cfg: dict, path: Path, device: torch.device | None = None) -> None:
    """Refuse an engine this runtime cannot run, naming what to rebuild: its format, plugin ABI, each plugin's
    version and tactic, its target. The stamp's torch, triton and k3build versions are the build machine's and stay
    a record: an engine holds weights and a graph, no compiled kernels (Triton compiles at run time), so one built
    on a CPU host with another torch runs on the GPU host's."""
    if why := not_an_engine(cfg, path) or check_engine_fields(cfg, path):
        raise EngineError(why)
    rebuild = f"rebuild it with `k3build build` from this installation"
    if cfg.get("version") != ENGINE_FORMAT_VERSION:
        raise EngineError(f"{path}: engine format v{cfg.get('version')} but this runtime reads v{ENGINE_FORMAT_VERSION}; {rebuild}")
    stamp = cfg["stamp"]
    if stamp.get("plugin_abi") != registry.PLUGIN_ABI:
        raise EngineError(f"{path}: built for plugin ABI {stamp.get('plugin_abi')}, this runtime has ABI {registry.PLUGIN_ABI}; {rebuild}")
    for op, p in cfg["build_config"]["plugins"].items():
        impl = registry.find(op, p["tactic"])
        if impl is None or impl.version != p["version"]:
            have = f"v{impl.version}" if impl else "none"
            raise EngineError(f"{path}: plugin {op}/{p['tactic']} v{p['version']} is not available here ({have}); {rebuild}")
    if device is not None:
        check_device_kind(cfg, path, device)
        check_device_present(device, path, stamp.get("target"))
        here, target = _device_target(device), stamp.get("target")
        if here != target:
            raise EngineError(f"{path}: engine built for target {target!r} but this device is {here!r}; "
                              f"rebuild with `k3build build --target {here if here in ('cpu', 'sm90', 'gfx942') else '<target>'}`")
        for op, p in cfg["build_config"]["plugins"].items():  # the table's tactics, found above
            impl = registry.find(op, p["tactic"])
            ok, why = impl.runs_on(here)
            if not ok:
                raise EngineError(f"{path}: plugin {op}/{p['tactic']} cannot run here ({why}); rebuild with "
                                  f"`k3build build --target {here}`")


def load_rank(engine_dir: str | Path, rank: int = 0, device: str | torch.device = "cpu",
              progress: bool = False, verify: bool = False) -> RankEngine:
    """verify: hash the weights file as it is read against the build's sha256 (EngineOptions.verify_weights)."""
    engine_dir, device = Path(engine_dir), torch.device(device)
    cfg = read_engine_config(engine_dir)
    check_stamp(cfg, engine_dir / "config.json", device)
    if str(rank) not in cfg["ranks"]:
        raise EngineError(f"{engine_dir}: no rank {rank} (world size {cfg['mapping']['world_size']})")
    rank_dir = engine_dir / f"rank{rank}"
    for name in ("graph.onnx", "weights.safetensors"):
        _check_readable(rank_dir / name)
    try:
        data = (rank_dir / "graph.onnx").read_bytes()
    except OSError as e:
        raise EngineError(_unreadable(rank_dir / "graph.onnx", e)) from None
    try:
        model = onnx.load_from_string(data)
    except Exception as e:  # protobuf DecodeError and friends
        raise EngineError(f"{rank_dir}/graph.onnx: not a valid ONNX model ({e}); rebuild the engine") from None
    build_id = cfg["stamp"].get("build_id")
    graph_build = next((p.value for p in model.metadata_props if p.key == "build_id"), None)
    if build_id and graph_build is not None and graph_build != build_id:  # graphs from before it: no check
        raise EngineError(f"{rank_dir}/graph.onnx: written by another build ({graph_build}) than the engine's "
                          f"config.json ({build_id}): files of two builds mixed; copy the engine whole again, or "
                          "rebuild it")
    if why := graph_problem(model, cfg, rank):
        raise EngineError(f"{rank_dir}/graph.onnx: {why}; rebuild the engine with `k3build build` from this "
                          "installation")
    # graph_problem names what the executor cannot bind; the build's record of the file (engines from before it have
    # none) refuses the rest: an attribute's name or value changed by one bit parses and binds, then fails at the
    # first step or runs another model
    built = cfg["ranks"][str(rank)].get("graph_sha256")
    if isinstance(built, str) and (here := hashlib.sha256(data).hexdigest()) != built:
        raise EngineError(f"{rank_dir}/graph.onnx: damaged since its build (sha256 {here[:12]}, config.json records "
                          f"{built[:12]}); copy the engine whole again, or rebuild it")
    graph = model.graph
    # A node's host weight store (k3runtime weight-store) is attached when configured; else read from disk.
    weights = _read_weights(rank_dir / "weights.safetensors", rank, cfg["ranks"][str(rank)],
                            cfg["stamp"].get("build_id"), device, progress,
                            attach=lambda: weight_store.attach(engine_dir, rank, device=device), verify=verify)
    if why := (_weights_problem(graph, weights) or _nonfinite_problem(weights)
               or _scales_problem(graph, weights, cfg["build_config"]["plugins"])):
        # the error's traceback holds this frame: empty the dict it holds, or a failed load keeps the rank's tensors
        # (on a GPU its whole device memory) for as long as the error lives (a notebook's sys.last_value, a retry)
        weights.clear()
        raise EngineError(f"{rank_dir}/weights.safetensors: {why}")
    return RankEngine(engine_dir, rank, cfg, ModelFacts.from_pretrained_config(cfg["pretrained_config"]), graph, weights)


def _unreadable(path: Path, e: OSError) -> str:
    """The error for an engine file that is there but cannot be read: its mode or its directory's, a directory in
    its place."""
    return f"{path}: cannot be read ({e.strerror or e})"


def _regular(path: Path) -> None:
    """EngineError for a pipe, socket or device in an engine file's place: open() of a FIFO waits for a writer, so
    the load would hang without a word. (A directory is left to open(), which says "Is a directory".)"""
    mode = path.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise EngineError(f"{path}: not a regular file (a pipe, socket or device in its place); copy the engine's "
                          "file there, or rebuild the engine")


def _check_readable(path: Path) -> None:
    """EngineError for an engine file that is missing or cannot be read, before its reader's own error (safetensors
    says FileNotFoundError for a file it may not read) or a traceback."""
    try:
        _regular(path)
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        raise EngineError(f"{path}: missing; the engine is incomplete — rebuild it with `k3build build`") from None
    except OSError as e:
        raise EngineError(_unreadable(path, e)) from None


def _read_weights(path: Path, rank: int, info: dict, build_id: str | None, device: torch.device,
                  progress: bool, attach=lambda: None, verify: bool = False) -> dict[str, torch.Tensor]:
    """The rank's weights: from the node's host store when `attach()` gives them, else from disk: on a GPU streamed
    through pinned buffers (weight_reader), on the CPU read straight into the tensors (not mapped: a private mapping
    still reads the file's pages as they are, so a file replaced in place — cp over it, rsync --inplace — would
    change a running engine's weights, and one truncated would kill it with SIGBUS). The header is checked first on
    all three (read_header names the tensor that does not fit), and its record of the rank and build it was written
    for (a file rewritten by another tool may have none): a store copies the file as it is, so it holds another
    rank's or build's file as faithfully. verify: the file's sha256 against the build's record (a store compared its
    copy with it already)."""
    built_sha = info.get("weights_sha256")
    if verify and not isinstance(built_sha, str):
        raise EngineError(f"{path}: its build recorded no sha256 of it (config.json ranks.{rank}.weights_sha256; "
                          "engines built before that record have none): nothing to verify it against; rebuild the "
                          "engine, or load it without verify_weights")
    try:
        _, _, metadata = read_header(path)
        if metadata.get("rank", str(rank)) != str(rank):
            raise EngineError(f"{path}: holds rank {metadata['rank']}'s weights, not rank {rank}'s (its header's "
                              "__metadata__ says so); put each rank's files back in its rank directory, or rebuild "
                              "the engine")
        if build_id and metadata.get("build_id", build_id) != build_id:  # engines from before build_id: no check
            raise EngineError(f"{path}: written by another build ({metadata['build_id']}) than the engine's "
                              f"config.json ({build_id}): files of two builds mixed; copy the engine whole again, or "
                              "rebuild it")
        if (attached := attach()) is not None:
            return attached
        digest = hashlib.sha256() if verify else None
        weights = read_weights(path, device, progress=progress, digest=digest)
        if digest is not None and (here := digest.hexdigest()) != built_sha:
            weights.clear()  # as below: the error must not keep the tensors alive
            raise EngineError(f"{path}: damaged since its build (sha256 {here[:12]}, config.json records "
                              f"{built_sha[:12]}); copy the engine whole again, or rebuild it")
        return weights
    except WeightFileError as e:
        why = str(e).removeprefix(f"{path}: ")
    # raised out of the except block: as its context, the reader's error would keep read_weights' frame, and every
    # tensor it had allocated, alive for as long as this one lives
    size, built = path.stat().st_size, info.get("weight_bytes")
    sizes = f"; it is {size} bytes, its build wrote {built}" if isinstance(built, int) and built != size else ""
    raise EngineError(f"{path}: corrupt ({why}){sizes}; rebuild the engine")


def _nonfinite_problem(weights: dict[str, torch.Tensor]) -> str | None:
    """Float weights holding NaN or Inf: convert refuses them in a checkpoint, so here they are a file damaged
    since (bytes overwritten in place keep its size), which would otherwise sample from NaN logits without a word.
    One test a tensor on the weights' device and one sync for them all. (A problem string, not an exception: one
    raised here would keep every tensor alive through this frame.)"""
    floats = [name for name, t in weights.items() if t.is_floating_point()]
    if not floats:
        return None
    ok = torch.stack([torch.isfinite(weights[name]).all() for name in floats]).cpu().tolist()
    bad = [name for name, good in zip(floats, ok) if not good]
    if bad:
        return (f"{len(bad)} tensor(s) hold NaN or Inf, the first {bad[0]!r}; the file was damaged after its build — "
                "rebuild the engine")
    return None


def _scales_problem(graph: onnx.GraphProto, weights: dict[str, torch.Tensor], plugins: dict) -> str | None:
    """MXFP4 expert scale bytes the build would not have written: past E8M0_MAX_FINITE (0xFF is NaN, 253 and 254
    decode to Inf), or, for a W4 tactic, past W4_MAX_SCALE_BYTE (its decode is inexact there, so the build steps
    down to triton_ds). _nonfinite_problem sees only float tensors, and one flipped bit of a scale byte of 2^0 (127)
    makes it 0xFF: NaN logits from every token routed to that expert. One max a tensor, one sync."""
    tactic = plugins.get("MoEExperts", {}).get("tactic")
    bound = W4_MAX_SCALE_BYTE if tactic in W4_TACTICS else E8M0_MAX_FINITE
    names = [n.input[i] for n in graph.node if n.op_type == "MoEExperts" and n.domain == "k3" for i in (4, 6)
             if len(n.input) > i and n.input[i] and weights[n.input[i]].dtype == torch.uint8
             and weights[n.input[i]].numel()]
    if not names:
        return None
    highest = torch.stack([weights[name].max() for name in names]).cpu().tolist()
    for name, byte in zip(names, highest):
        if byte > bound:
            return (f"{name!r} holds E8M0 scale byte 0x{byte:02X}, past {bound} (the most a {tactic} engine's build "
                    "writes); the file was damaged after its build — rebuild the engine")
    return None


def _weights_problem(graph: onnx.GraphProto, weights: dict[str, torch.Tensor]) -> str | None:
    for vi in graph.input:
        t = vi.type.tensor_type
        if any(d.dim_param for d in t.shape.dim):
            continue  # a data input (symbolic dims), bound per step
        if vi.name not in weights:
            return f"tensor {vi.name!r} declared by graph.onnx is missing"
        shape = tuple(d.dim_value for d in t.shape.dim)
        w = weights[vi.name]
        if tuple(w.shape) != shape or w.dtype != ONNX_TO_TORCH[t.elem_type]:
            return f"{vi.name!r} is {tuple(w.shape)} {w.dtype}, graph expects {shape} {ONNX_TO_TORCH[t.elem_type]}"
    return None
