"""Per-rank heartbeats in the job's store, so that a collective timeout can name the rank that went silent.

A rank that dies is named by torchrun; a rank that hangs (stopped, stuck in a kernel, a lost node) only
makes its peers' collectives time out, and they cannot tell who is missing. Every rank stamps the time into
the store that torch.distributed was initialised with, from a daemon thread. A thread keeps beating while
its rank waits inside a collective, and stops when the process stops or leaves (stop). After a timeout, the
ranks whose stamps do not move for a few seconds are the silent ones.

The store is the job's lifeline (the torchrun agent of the rendezvous host holds it: MASTER_ADDR's, on node 0, which
need not be this rank's own agent): a rank whose beats fail ORPHAN_BEATS times in a row (or once on its closed socket:
STORE_GONE) has lost it, that agent killed, gone with its node, or ended with a failure of its own ranks, and no one
is left to stop it; it stops itself (SIGTERM, so that a server shuts down; a hard exit if that does not end it),
rather than serving on as an orphan that holds the accelerator and the server's port.

A rank that hangs while its process lives on (a blocking call, a deadlock on the host) keeps beating. So each beat
also carries how many collectives the rank has entered on each of its groups and the one it waits in (collective):
the members of a group enter its collectives in one order, so a live rank that entered fewer of a group's than
another member did, and waits in none, is the one the others wait for (stuck_ranks).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager

import torch.distributed as dist

PERIOD_S = 1.0
ORPHAN_BEATS = 3  # beats failed in a row: the store is gone (its torchrun agent killed?), this rank stops itself
# a beat failed with one of these has found the store's socket closed, not a slow store: no use trying twice more
# (each failed beat also costs a dozen lines of TCPStore's C++ warning in the log)
STORE_GONE = ("broken pipe", "connection reset", "connection refused")
ORPHAN_GRACE_S = 30.0  # after its SIGTERM, how long an orphaned rank may take to stop before a hard exit
_KEY = "k3/heartbeat/{}"


def _store():
    # the store env:// initialisation made (torchrun's); private, but in every torch 2.x
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


LEFT = "left"  # the beat of a rank that stopped beating on purpose (stop): never named as silent
_beating: list[tuple[threading.Thread, threading.Event, object, int]] = []
_entered: dict[str, int] = {}  # collectives this rank entered, by group key (group_key)
_waiting: list[str | None] = [None]  # the group key of the collective it waits in (or failed in), else None


def group_key(name: str, members: Iterable[int]) -> str:
    """A group's key in the beats: its name and its ranks (two TP groups are two groups)."""
    return f"{name}:{','.join(map(str, sorted(members)))}"


@contextmanager
def collective(key: str):
    """Around a collective on the group `key`: counted when entered; while it blocks, and after it failed, the
    rank's beat says it waits there."""
    _entered[key] = _entered.get(key, 0) + 1
    _waiting[0] = key
    yield
    _waiting[0] = None  # (left set when the collective raised: the rank was waiting for a peer)


def _state() -> dict:
    """What a beat says: its time, the collectives entered by group, the one waited in."""
    return {"t": time.time(), "n": dict(_entered), "in": _waiting[0]}


def start() -> None:
    """Beat for this rank until stop() (no-op without a store)."""
    store, rank = _store(), dist.get_rank()
    if store is None:
        return
    done = threading.Event()
    thread = threading.Thread(target=_beat, args=(store, rank, done), name=f"k3-heartbeat-{rank}", daemon=True)
    thread.start()
    _beating.append((thread, done, store, rank))


def _beat(store, rank: int, done: threading.Event) -> None:
    """The beating thread: this rank's state every PERIOD_S until done, or until the store is found gone."""
    failed = 0
    while not done.is_set():
        try:
            store.set(_KEY.format(rank), json.dumps(_state()))
            failed = 0
        except Exception as e:  # noqa: BLE001 - the store went away with the job, or a hiccup
            failed += 1
            gone = any(words in str(e).lower() for words in STORE_GONE)
            if (gone or failed >= ORPHAN_BEATS) and not done.is_set():
                _orphaned(rank, e, done)
                return
        done.wait(PERIOD_S)


def _orphaned(rank: int, error: BaseException, done: threading.Event) -> None:
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    # on another node than the store's, this rank's own agent is alive: the store's is the one gone
    print(f"k3runtime: rank {rank} lost the job's store at {where} ({error}): the torchrun agent that holds it (the "
          "rendezvous host's) is gone, killed or ended with its node's ranks; this rank stops", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    if not done.wait(ORPHAN_GRACE_S):  # (stop() sets it on the way out)
        os._exit(1)


def stop() -> None:
    """Stop beating before the process group goes (a beat still inside the store's C++ client while the process
    exits may abort it: "terminate called without an active exception"; a beat stuck past 5 s on an unresponsive
    store is left behind), and mark this rank as left, so that no peer names it as hung."""
    while _beating:
        thread, done, store, rank = _beating.pop()
        done.set()
        thread.join(timeout=5 * PERIOD_S)
        try:
            store.set(_KEY.format(rank), LEFT)
        except Exception:  # the store went away with the job
            pass


def _stamps() -> dict[int, str]:
    """Every other rank's last beat, of those that have beaten; {} when the store cannot be read (it went with the
    job: the timeout itself is then the error to show)."""
    store = _store()
    if store is None:
        return {}
    me, keys = dist.get_rank(), {r: _KEY.format(r) for r in range(dist.get_world_size())}
    try:
        return {r: store.get(k).decode() for r, k in keys.items() if r != me and store.check([k])}
    except Exception:
        return {}


def silent_ranks(watch_s: float) -> list[int]:
    """The other ranks whose beat does not move in `watch_s` seconds (more than a few beats). Only whether a
    beat changes counts, never its time against this rank's clock, so clocks that differ between nodes name
    no one. Meanwhile the live ranks, waiting in their collectives or in this same watch, beat on."""
    before = _stamps()
    if not before:
        return []
    time.sleep(watch_s)
    after = _stamps()
    return sorted(r for r, beat in after.items() if beat == before.get(r) and beat != LEFT)


class RankLost(RuntimeError):
    """A collective failed because of another rank (timed out on it, or lost it); the message names it."""


def explain(exc: BaseException, timeout_s: float) -> str | None:
    """explain_timeout's or explain_lost_peer's message for a failed collective (a RankLost's own); else None."""
    if isinstance(exc, RankLost):
        return str(exc)
    return explain_timeout(exc, timeout_s) or explain_lost_peer(exc)


def explain_timeout(exc: BaseException, timeout_s: float) -> str | None:
    """A message naming the silent ranks when `exc` is a collective timeout, or else the stuck ones (stuck_ranks);
    None otherwise (after watching the beats for up to 5 s)."""
    message = str(exc).lower()
    # gloo says either, as its side of a pair or the peer's gives up first
    if "timed out" not in message and "timeout caused pair closure" not in message:
        return None
    watch_s = max(3 * PERIOD_S, min(5.0, timeout_s / 2))
    silent = silent_ranks(watch_s)
    head = f"a collective timed out after {timeout_s:.0f} s (K3_DIST_TIMEOUT_S): "
    if silent:
        names = ", ".join(f"rank {r}" for r in silent)
        return (head + f"{names} stopped responding (no heartbeat in {watch_s:.0f} s); the others were alive and "
                "waiting for it")
    if stuck := stuck_ranks():
        names = "; ".join(f"rank {r} (group {_group_text(key)}: it entered {n} of its collectives, another member "
                          f"{top})" for r, (key, n, top) in stuck)
        return (head + f"{names} {'is' if len(stuck) == 1 else 'are'} alive but waits in no collective: stuck in "
                "its own work (a blocking call, a kernel, a deadlock); the others were waiting for it")
    return None


def _group_text(key: str) -> str:
    """A group key ("name:0,1,2": its name and member ranks) as the messages write it: name [0,1,2]."""
    name, members = key.rsplit(":", 1)
    return f"{name} [{members}]"


def stuck_ranks() -> list[tuple[int, tuple[str, int, int]]]:
    """The live ranks (this one included) that entered fewer of a group's collectives than another member and wait
    in none: [(rank, (group key, its count, the most a member entered))]. A rank waiting for another, even behind
    on some group, waits inside a collective, so only the rank the wait started from is named."""
    beats = {}
    for r, beat in _stamps().items():
        try:
            beat = json.loads(beat)
        except ValueError:  # left
            continue
        if isinstance(beat, dict):
            beats[r] = beat
    beats[dist.get_rank()] = _state()
    found = {}
    for key in sorted(set().union(*(b.get("n", {}) for b in beats.values()))):
        counts = {r: beats[r].get("n", {}).get(key, 0) for r in map(int, key.rsplit(":", 1)[1].split(","))
                  if r in beats}
        top = max(counts.values(), default=0)
        for r, n in counts.items():
            if n < top and beats[r].get("in") is None and r not in found:
                found[r] = (key, n, top)
    return sorted(found.items())


def explain_lost_peer(exc: BaseException) -> str | None:
    """A message naming the ranks that left the job when `exc` is a collective that lost its peer (gloo's closed
    connection: a rank that failed, at start-up say, and exited with its own error), or else the ranks that died
    without leaving (killed, crashed, their node lost: their beat stopped, never marked left); else None."""
    message = str(exc).lower()
    if "connection closed by peer" not in message and "connection reset by peer" not in message:
        return None
    left = sorted(r for r, beat in _stamps().items() if beat == LEFT)
    if left:
        return f"{', '.join(f'rank {r}' for r in left)} left the job (its own error says why); this rank's " \
               "collective lost it"
    watch_s = 3 * PERIOD_S
    if dead := silent_ranks(watch_s):
        return (f"{', '.join(f'rank {r}' for r in dead)} died without an error of its own (killed, crashed or its "
                f"node lost: no heartbeat in {watch_s:.0f} s, and it did not leave); this rank's collective lost it")
    return "another rank left the job; this rank's collective lost it"
