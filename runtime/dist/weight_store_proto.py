"""Weight-store pieces both sides share, torch-free: engine fingerprints and the one-line JSON control protocol.

A rank's fingerprint is its weights file size, the sha256 of its safetensors header (tensor names, dtypes, shapes,
offsets) and the sha256 of a few 4 KiB windows spread over the data, so a rebuild with other values but the same
shapes still differs; computing it reads a few pages, never the whole file.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine_dir import no_config, not_an_engine

PROTOCOL_VERSION = 1
SAMPLE_WINDOWS, SAMPLE_BYTES = 16, 4096
MAX_HEADER_BYTES = 100 << 20
MAX_REPLY_BYTES = 1 << 20


@dataclass(frozen=True)
class RankPrint:
    size: int
    header_sha256: str
    sample_sha256: str

    def differences(self, other: "RankPrint") -> list[str]:
        """Human-readable fields where `other` differs from self."""
        out = []
        if self.size != other.size:
            out.append(f"size {self.size} vs {other.size} bytes")
        if self.header_sha256 != other.header_sha256:
            out.append(f"header (tensor names/dtypes/shapes) sha256 {self.header_sha256[:12]} vs {other.header_sha256[:12]}")
        if self.sample_sha256 != other.sample_sha256:
            out.append(f"sampled weight bytes sha256 {self.sample_sha256[:12]} vs {other.sample_sha256[:12]}")
        return out


def read_header(path: str | Path) -> tuple[bytes, int]:
    """Raw JSON header bytes of a safetensors file and the offset where its data begins."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n + 8 > os.fstat(f.fileno()).st_size:
            raise ValueError(f"{path}: not a safetensors file (header length {n} does not fit the file)")
        return f.read(n), 8 + n


def rank_print(path: str | Path) -> RankPrint:
    header, data_start = read_header(path)
    size = os.path.getsize(path)
    span = max(size - data_start, 0)
    sample = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        for i in range(SAMPLE_WINDOWS):
            # evenly spaced windows, the last one ending at the end of the file
            off = data_start + (max(span - SAMPLE_BYTES, 0) * i) // (SAMPLE_WINDOWS - 1)
            sample.update(os.pread(fd, SAMPLE_BYTES, off))
    finally:
        os.close(fd)
    return RankPrint(size, hashlib.sha256(header).hexdigest(), sample.hexdigest())


def config_sha256(engine_dir: str | Path) -> str:
    path = Path(engine_dir) / "config.json"
    if not path.is_file():
        raise ValueError(no_config(engine_dir))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rank_records(engine_dir: str | Path) -> dict[int, object]:
    """rank -> its record in the engine's config.json (`ranks`)."""
    path = Path(engine_dir) / "config.json"
    if not path.exists():
        raise ValueError(no_config(engine_dir))
    try:
        cfg = json.loads(path.read_text())
        if why := not_an_engine(cfg, path):
            raise ValueError(why)
        return {int(r): info for r, info in cfg["ranks"].items()}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: cannot read the engine's rank list ({type(e).__name__}: {e})") from None


def engine_ranks(engine_dir: str | Path) -> list[int]:
    """Ranks an engine's config.json declares."""
    return sorted(rank_records(engine_dir))


def built_sha256(records: dict[int, object]) -> dict[int, str]:
    """rank -> the sha256 the build recorded of its weights file (ranks.N.weights_sha256 of rank_records), where it
    did (engines from before have none)."""
    return {r: info["weights_sha256"] for r, info in records.items()
            if isinstance(info, dict) and isinstance(info.get("weights_sha256"), str)}


def weights_path(engine_dir: str | Path, rank: int) -> Path:
    return Path(engine_dir) / f"rank{rank}" / "weights.safetensors"


def fingerprint(config_sha: str, prints: dict[int, RankPrint]) -> str:
    """One short id for display: the engine config and the fingerprints of the ranks a store holds."""
    h = hashlib.sha256(config_sha.encode())
    for rank in sorted(prints):
        h.update(json.dumps([rank, asdict(prints[rank])]).encode())
    return h.hexdigest()[:16]


def request(socket_path: str | Path, message: dict, timeout_s: float) -> dict:
    """Send one JSON line to a store's control socket and return its JSON reply.

    Raises OSError (missing socket, refused, timed out) or ValueError (a reply that is not the protocol).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(socket_path))
        s.sendall(json.dumps(message).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_REPLY_BYTES:
                raise ValueError(f"reply from {socket_path} exceeds {MAX_REPLY_BYTES} bytes")
    try:
        reply = json.loads(buf)
    except json.JSONDecodeError:
        raise ValueError(f"{socket_path} answered {buf[:80]!r}, not a weight-store reply") from None
    if not isinstance(reply, dict) or reply.get("protocol") != PROTOCOL_VERSION:
        raise ValueError(f"{socket_path} speaks weight-store protocol {reply.get('protocol') if isinstance(reply, dict) else '?'}, "
                         f"this runtime speaks {PROTOCOL_VERSION}")
    return reply


def parse_ranks(text: str | list | tuple, where: str) -> tuple[int, ...]:
    """'0,1,4-7' (or a list of ints / such strings) -> (0, 1, 4, 5, 6, 7); ValueError names `where`."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[int] = []
    for item in items:
        try:
            if isinstance(item, int) and not isinstance(item, bool):
                out.append(item)
                continue
            lo, _, hi = str(item).strip().partition("-")
            out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
        except ValueError:
            raise ValueError(f"{where}: rank list item {item!r} is not an int or a range like 0-7") from None
    if not out or min(out) < 0 or len(set(out)) != len(out):
        raise ValueError(f"{where}: rank list {text!r} must be non-empty, non-negative, without repeats")
    return tuple(sorted(out))
