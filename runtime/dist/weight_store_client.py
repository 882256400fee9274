"""Rank side of the host weight store: find this node's store, check it holds this engine, map its copy.

The distributed weight config (`--distributed-weight-config FILE` or $K3_WEIGHT_STORE_CONFIG), JSON or TOML:

    {"nodes": {"gpu-node-0": {"socket": "/dev/shm/k3ws-k3/store.sock", "ranks": "0-7"},
               "gpu-node-1": {"socket": "/dev/shm/k3ws-k3/store.sock", "ranks": [8, 9, 10, 11, 12, 13, 14, 15]}}}

A node is matched by hostname (full, then the part before the first dot), then by a "*" entry.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from ..loader import EngineError
from ..weight_reader import WeightFileError, read_header
from . import weight_store_proto as proto

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ENV_CONFIG = "K3_WEIGHT_STORE_CONFIG"
DEFAULT_TIMEOUT_S = 3.0


class WeightStoreError(EngineError):
    """A configured store cannot serve this rank (dead, still loading, other engine); the message says which."""


@dataclass(frozen=True)
class StoreEntry:
    node: str
    socket: Path
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class WeightStoreConfig:
    """Which store (control socket) holds which ranks, per node."""

    nodes: tuple[StoreEntry, ...]
    source: str = "<dict>"

    @classmethod
    def load(cls, path: str | Path) -> "WeightStoreConfig":
        path = Path(path)
        try:
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (OSError, ValueError) as e:
            raise WeightStoreError(f"distributed weight config {path}: cannot read it ({type(e).__name__}: {e})") from None
        return cls.from_dict(data, str(path), base=path.parent)

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>", base: Path | None = None) -> "WeightStoreConfig":
        nodes = data.get("nodes") if isinstance(data, dict) else None
        if not isinstance(nodes, dict) or not nodes:
            raise WeightStoreError(f"distributed weight config {source}: needs a non-empty 'nodes' table "
                                   f"(node name -> {{socket, ranks}})")
        entries = []
        for node, e in nodes.items():
            where = f"distributed weight config {source}: nodes.{node}"
            if not isinstance(e, dict) or "socket" not in e or "ranks" not in e:
                raise WeightStoreError(f"{where}: needs 'socket' (path) and 'ranks' (e.g. [0, 1] or \"0-7\")")
            try:
                ranks = proto.parse_ranks(e["ranks"], f"{where}.ranks")
            except ValueError as err:
                raise WeightStoreError(str(err)) from None
            sock = Path(e["socket"])
            entries.append(StoreEntry(str(node), sock if sock.is_absolute() or base is None else base / sock, ranks))
        return cls(tuple(entries), source)

    def entry_for(self, rank: int, host: str | None = None) -> StoreEntry | None:
        """This node's store for `rank`, or None when the config gives this node none for it."""
        host = host or socket.gethostname()
        by_node = {e.node: e for e in self.nodes}
        for key in (host, host.split(".")[0], "*"):
            if key in by_node:
                return by_node[key] if rank in by_node[key].ranks else None
        return None


def resolve_config(config=None) -> WeightStoreConfig | None:
    """`config` (a WeightStoreConfig, a dict or a file path), else $K3_WEIGHT_STORE_CONFIG, else None."""
    if config is None:
        config = os.environ.get(ENV_CONFIG) or None
        if config is None:
            return None
    if isinstance(config, WeightStoreConfig):
        return config
    if isinstance(config, dict):
        return WeightStoreConfig.from_dict(config)
    return WeightStoreConfig.load(config)


def store_status(socket_path: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """A store's status reply; WeightStoreError (never a hang) when it is missing, dead or mute."""
    try:
        return proto.request(socket_path, {"op": "status"}, timeout_s)
    except FileNotFoundError:
        raise WeightStoreError(f"weight store at {socket_path}: no such socket (store not started, or stopped)") from None
    except ConnectionRefusedError:
        raise WeightStoreError(f"weight store at {socket_path}: connection refused (the store process is dead; "
                               f"restart `k3runtime weight-store`)") from None
    except (socket.timeout, TimeoutError):
        raise WeightStoreError(f"weight store at {socket_path}: no answer within {timeout_s:g} s") from None
    except (OSError, ValueError) as e:
        raise WeightStoreError(f"weight store at {socket_path}: {e}") from None


def attach(engine_dir: str | Path, rank: int, *, config=None, device: str | torch.device = "cpu",
           timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, torch.Tensor] | None:
    """Tensors of `rank` from this node's weight store, or None when no store is configured for this rank.

    Args:
        engine_dir: the engine the rank runs; its config.json and weights header must match the store's.
        config: WeightStoreConfig, dict or file path; None reads $K3_WEIGHT_STORE_CONFIG.
        device: "cpu" gives copy-on-write views of the shared copy (no bytes copied); else tensors are copied there.
    Returns:
        name -> tensor, bit-identical to `rank{N}/weights.safetensors`.
    Raises:
        WeightStoreError: the configured store is dead, silent, still loading, lacks the rank or holds another engine.
    """
    cfg = resolve_config(config)
    entry = cfg.entry_for(rank) if cfg is not None else None
    if entry is None:
        return None
    where = f"weight store {entry.socket} (node {entry.node!r} in {cfg.source}), rank {rank}"
    status = store_status(entry.socket, timeout_s=timeout_s)
    if status.get("state") != "ready":
        raise WeightStoreError(f"{where}: store is {status.get('state')} ({status.get('loaded_bytes', 0) / 2**30:.2f} of "
                               f"{status.get('total_bytes', 0) / 2**30:.2f} GiB copied); wait for its 'ready' line")
    held = status.get("ranks", {}).get(str(rank))
    if held is None:
        raise WeightStoreError(f"{where}: the store holds ranks {sorted(int(r) for r in status.get('ranks', {}))}, "
                               f"not {rank}; fix the config or the store's --ranks")
    try:
        disk_config = proto.config_sha256(engine_dir)
        disk = proto.rank_print(proto.weights_path(engine_dir, rank))
    except (OSError, ValueError) as e:
        raise WeightStoreError(f"{where}: cannot fingerprint {engine_dir} ({e})") from None
    store_print = proto.RankPrint(held["size"], held["header_sha256"], held["sample_sha256"])
    diffs = ([f"config.json sha256 {status['config_sha256'][:12]} vs {disk_config[:12]}"]
             if status.get("config_sha256") != disk_config else []) + store_print.differences(disk)
    if diffs:
        raise WeightStoreError(f"{where}: the store holds another engine ({status.get('engine_dir')}) than {engine_dir}: "
                               f"store vs disk: {'; '.join(diffs)}")
    path = Path(held["path"])
    try:
        copy = proto.rank_print(path)
    except (OSError, ValueError) as e:
        raise WeightStoreError(f"{where}: its copy {path} is unreadable ({e}); restart the store") from None
    if diffs := disk.differences(copy):
        raise WeightStoreError(f"{where}: its copy {path} differs from {engine_dir}: disk vs copy: {'; '.join(diffs)}")
    tensors = map_tensors(path)
    device = torch.device(device)
    return tensors if device.type == "cpu" else {k: v.to(device) for k, v in tensors.items()}


def map_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Copy-on-write views of a safetensors file's tensors: pages are shared with the file, writes stay private.
    The header is checked as a read from disk checks it (weight_reader.read_header): every tensor inside the file,
    of its dtype's size."""
    try:
        entries, data_start, _ = read_header(Path(path))
    except WeightFileError as e:
        raise WeightStoreError(f"weight store copy {e}; restart the store") from None
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive as long as any view lives
    out = {}
    for name, (dtype, shape, start, end) in entries.items():
        raw = base[data_start + start:data_start + end]
        try:
            t = raw.view(dtype)
        except RuntimeError:
            t = raw.clone().view(dtype)  # offset not a multiple of the element size
        out[name] = t.view(shape)
    return out
