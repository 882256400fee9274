"""Multi-rank entry under torchrun: rank 0 drives (scheduler + API), every other rank runs `worker_loop`.

    torchrun --nproc-per-node 4 -m k3runtime.dist.launch ENGINE generate --prompt "Hi"

Any k3runtime subcommand that opens an engine works after ENGINE. torchrun supplies RANK / WORLD_SIZE /
MASTER_ADDR (multi-node included); a rank that dies makes torchrun stop the others and name it, and a rank
that hangs trips the collective timeout (K3_DIST_TIMEOUT_S, default 60 s), and rank 0's error names it from
its stale heartbeat (heartbeat.py), so the job never hangs silently.
"""

from __future__ import annotations

import json
import os
import sys
import time

import click
import torch
import torch.distributed as dist

from ..loader import EngineError, read_engine_config
from . import heartbeat
from .comm import DistCommunicator, collective_timeout, sampling_rank
from .exchange import choose_backend, make_exchange


def init_from_env(device: str = "cpu", world: int | None = None) -> None:
    """torch.distributed from torchrun's environment; EngineError outside torchrun, with the command to run (its
    process count the engine's `world` of ranks where known)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise EngineError("a multi-rank engine runs under torchrun: "
                          f"`torchrun --nproc-per-node {world or 'N'} -m k3runtime.dist.launch ENGINE <command> ...`")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt == 0:
        dist.init_process_group(backend, timeout=collective_timeout())
    else:
        # After a torchrun restart the job's store still holds the first attempt's addresses, and a new rank
        # would dial a peer that is gone: this attempt's keys get their own prefix.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0 and not agent_store, timeout=collective_timeout())
        dist.init_process_group(backend, store=dist.PrefixStore(f"k3/attempt{attempt}", store), rank=rank,
                                world_size=world, timeout=collective_timeout())
    heartbeat.start()


_PREFLIGHT = "k3/preflight/{}"


def _poll(done, timeout_s: float) -> bool:
    """Whether done() came true within timeout_s, asked every 50 ms: TCPStore.wait holds the GIL, and this rank's
    heartbeat would stop with it."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def preflight(engine_dir: str) -> None:
    """Every rank reads its engine's config and the ranks compare them (build id, rank count, or the error reading
    it) through the job's store, before any process group is made. The groups come from each rank's config: ranks
    of engines with other mappings would make other groups and wait in them for each other until the timeout, and
    the peers of a rank that cannot read its engine (a node without the engine dir) would wait there for it."""
    rank, world, store = dist.get_rank(), dist.get_world_size(), heartbeat._store()
    try:
        config = read_engine_config(engine_dir)
        mine = {"build": config["stamp"].get("build_id"), "world": config["mapping"]["world_size"]}
    except EngineError as e:
        mine = {"error": str(e)}
    if store is not None and world > 1:
        store.set(_PREFLIGHT.format(rank), json.dumps(mine))
        keys = [_PREFLIGHT.format(r) for r in range(world)]
        if not _poll(lambda: store.check(keys), collective_timeout().total_seconds()):
            late = [r for r, k in enumerate(keys) if not store.check([k])]
            raise EngineError(f"rank(s) {', '.join(map(str, late))} did not report their engine within "
                              f"{collective_timeout().total_seconds():.0f} s (K3_DIST_TIMEOUT_S)")
        every = [json.loads(store.get(k)) for k in keys]
    else:
        every = [mine]
    if "error" in mine:
        raise EngineError(mine["error"])
    if failed := [r for r, m in enumerate(every) if "error" in m]:
        raise EngineError(f"rank(s) {', '.join(map(str, failed))} cannot open their engine: "
                          f"{every[failed[0]]['error']}")
    if mine["world"] != world:
        raise EngineError(f"the engine has {mine['world']} ranks but torchrun started {world} processes; "
                          f"use --nproc-per-node/--nnodes for {mine['world']}")
    if odd := [r for r, m in enumerate(every) if m["build"] != every[0]["build"] or m["world"] != every[0]["world"]]:
        raise EngineError(f"the ranks opened engines of different builds: rank 0's is {every[0]['build']}, rank(s) "
                          f"{', '.join(map(str, odd))} another ({every[odd[0]]['build']}); give every rank a copy of "
                          "the same engine dir")


def _communicator(config: dict, device: str) -> DistCommunicator:
    world = config["mapping"]["world_size"]
    init_from_env(device, world)
    if dist.get_world_size() != world:
        raise EngineError(f"the engine has {world} ranks but torchrun started {dist.get_world_size()} processes; "
                          f"use --nproc-per-node/--nnodes for {world}")
    comm = DistCommunicator(config["ranks"], dist.get_rank(), config["mapping"]["tp_size"], torch.device(device))
    # every rank's engine dir from the same build (a stale copy on one node would run and generate nonsense)
    ids = [None] * world
    dist.all_gather_object(ids, config["stamp"].get("build_id"), group=comm.control.group)
    if len(set(ids)) > 1:
        odd = [r for r, i in enumerate(ids) if i != ids[0]]
        raise EngineError(f"the ranks opened engines of different builds: rank 0's is {ids[0]}, rank(s) "
                          f"{', '.join(map(str, odd))} another ({ids[odd[0]]}); give every rank a copy of the same "
                          "engine dir")
    return comm


_live: list[DistCommunicator] = []  # driver communicators whose workers still wait for steps
# Rank 0 in the job's store: it opens the engine (the workers then make the groups with it), or its command ended
# without (help, a refused flag or prompt, a port in use: the workers leave, with its error if any)
_DRIVER_OPENS, _DRIVER_ENDED = "k3/driver/opens", "k3/driver/ended"


def _tell_workers(key: str, value: str = "") -> None:
    store = heartbeat._store()
    if store is not None and dist.get_world_size() > 1:
        try:
            store.set(key, value)
        except Exception:  # noqa: BLE001 - the store gone: the workers' own timeout ends them, the error stays ours
            pass


def _wait_for_driver() -> None:
    """A worker: wait until rank 0 opens the engine (return), or ends its command without (SystemExit: with rank
    0's error, or 0)."""
    store = heartbeat._store()
    if store is None:
        return
    # on a timeout the groups' creation times out and names no one; rank 0 may still come
    _poll(lambda: store.check([_DRIVER_OPENS]) or store.check([_DRIVER_ENDED]), collective_timeout().total_seconds())
    if not store.check([_DRIVER_OPENS]) and store.check([_DRIVER_ENDED]):
        error = store.get(_DRIVER_ENDED).decode()
        if error:
            raise EngineError(f"rank 0 ended before it opened the engine: {error}")
        raise SystemExit(0)


def driver_comm(config: dict, device: str, options) -> DistCommunicator:
    """Rank 0: join the groups and hand every worker the runtime options (cache sizes must agree)."""
    _tell_workers(_DRIVER_OPENS)
    comm = _communicator(config, device)
    comm.control.broadcast(options)
    _attach_exchange(comm, config, options)
    _live.append(comm)
    return comm


def _attach_exchange(comm: DistCommunicator, config: dict, options) -> None:
    backend = choose_backend(config, options.enable_deepep)
    comm.use_exchange(make_exchange(backend, config, comm.rank, comm.groups.get("moe"), upcast=comm.upcast))


def release_workers(comm: DistCommunicator) -> None:
    from ..rank_runner import Step

    if comm in _live:
        _live.remove(comm)
        if comm.keep_alive is not None:
            comm.keep_alive.stop()
        # A driver that failed opening its rank leaves its workers elsewhere (the load barrier, under a 30-minute
        # timeout), and one whose step failed (a Ctrl-C, an error) may leave them inside that step's collectives:
        # a stop would wait for them for the step timeout; this process's exit ends their wait at once.
        if comm.opened and not comm.broken:
            comm.control.broadcast((Step((), stop=True),))


def _release_all(quiet: bool = False) -> None:
    """Release every driver communicator's workers; quiet: errors (a worker that cannot be reached) are dropped."""
    for comm in list(_live):
        try:
            release_workers(comm)
        except Exception:
            if not quiet:
                raise


def worker_loop(engine_dir: str, device: str = "cpu") -> None:
    """Ranks > 0: load this rank, then run every broadcast Step until the driver says stop."""
    from ..engine_options import cache_sizes
    from ..llm_engine import HostCopy, empty_sampled, open_rank, sample_with_logprobs, wants_rows
    from ..penalties import SeenCounts

    config = read_engine_config(engine_dir)
    _wait_for_driver()
    comm = _communicator(config, device)
    rank = dist.get_rank()
    options = comm.control.broadcast()
    _attach_exchange(comm, config, options)
    runner = open_rank(engine_dir, options, rank, comm)
    tp_rank, attention_dp = config["ranks"][str(rank)]["tp_rank"], config["mapping"]["attention_dp"]
    # Without attention-DP one rank of the last stage reports for its TP group; with it every rank has its own.
    reports = runner.last and (tp_rank == 0 or attention_dp)
    sampler = sampling_rank(config["mapping"])
    # async scheduling: the last step's sampled ids on this device, which the next step feeds (shared by the
    # last stage's first rank: the driver without pipeline stages; under attention-DP this rank's own); and,
    # under attention-DP, on their way to the host, owed to the driver once the next step is launched
    # Logprobs' rows (when an item asks: for its sampled token or its prompt) follow the ids, by the same route.
    fed, owed, vocab = None, [], runner.engine.facts.vocab_size
    seen = SeenCounts(cache_sizes(config, options)[1])  # the penalties' counts of the requests this rank samples
    while True:
        steps = comm.control.broadcast()
        if steps[0].stop:
            break
        if steps[0].keep_alive:
            continue
        step = steps[tp_rank if attention_dp else 0]
        logits = runner.run(step, fed if step.feed else None)
        if options.async_scheduling and attention_dp:  # a DP rank's steps never score: the driver's does
            fed, rows = sample_with_logprobs(step, logits, fed if step.feed else None, seen)
            for t in owed:
                comm.control.send_result(t.wait(collective_timeout().total_seconds()), dst=0)
            owed = [HostCopy(t) for t in (fed, rows) if t is not None]
        elif options.async_scheduling and not step.all_logits:
            last, fed = fed if step.feed else None, None
            # a step of prompt chunks alone may still have prompt logprobs' rows
            if any(it.sample for it in step.items) or wants_rows(step):
                fed, rows = sample_with_logprobs(step, logits, last, seen) if rank == sampler else \
                    empty_sampled(step, vocab, runner.device)
                if fed.numel():
                    comm.share_tokens(fed, src=sampler)
                if rows is not None and sampler != 0:  # where the driver samples, it has its own rows
                    comm.share_tokens(rows, src=sampler)
        elif reports:
            results = (logits,) if step.all_logits else sample_with_logprobs(step, logits, seen=seen)
            for t in results:
                if t is not None:
                    comm.control.send_result(t, dst=0)


def run(engine_dir: str, driver_fn, device: str = "cpu"):
    """Call `driver_fn()` on rank 0 (it opens the engine), serve as a worker elsewhere; returns its result."""
    init_from_env(device)
    try:
        try:
            preflight(engine_dir)
            if dist.get_rank() == 0:
                try:
                    result = driver_fn()
                except BaseException as e:
                    _tell_workers(_DRIVER_ENDED, _one_line(e))  # (read only by workers it never joined)
                    # a hung worker makes the release time out too: the driver's own error is the one to show
                    _release_all(quiet=True)
                    raise
                _tell_workers(_DRIVER_ENDED)
                _release_all()
                return result
            worker_loop(engine_dir, device)
        except Exception as e:
            # name the rank that went silent, when that is why a collective timed out, or the ranks that left
            why = heartbeat.explain(e, collective_timeout().total_seconds())
            if why:
                raise EngineError(why) from e
            raise
    finally:
        try:
            heartbeat.stop()
        finally:
            dist.destroy_process_group()


def _one_line(e: BaseException) -> str:
    """A driver's error as the workers tell it (the CLI's own message for a click error)."""
    if isinstance(e, click.ClickException):
        return e.format_message()
    if isinstance(e, (SystemExit, click.exceptions.Exit)):
        code = getattr(e, "code", getattr(e, "exit_code", 0))
        return "" if code in (0, None) else f"exit status {code}"
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _option(command: list[str], name: str) -> str | None:
    """The value of `name VALUE` or `name=VALUE` in a command line, else None."""
    for i, arg in enumerate(command):
        if arg == name and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        raise SystemExit("usage: torchrun ... -m k3runtime.dist.launch ENGINE <k3runtime command> [args]")
    engine_dir, command = argv[0], argv[1:]
    given = _option(command, "--device") or "cpu"
    if given.startswith("cuda:"):
        # rank 0's options go to every rank: each would read its weights onto that one GPU, while its collectives
        # run on its LOCAL_RANK's
        click.echo(f"Error (rank {os.environ.get('RANK', '?')}): --device {given}: under torchrun every rank takes "
                   "the GPU of its LOCAL_RANK; give --device cuda (CUDA_VISIBLE_DEVICES chooses the node's GPUs)",
                   err=True)
        raise SystemExit(2)
    device = "cuda" if given.startswith("cuda") else "cpu"
    if weights := _option(command, "--distributed-weight-config"):
        # Only rank 0 parses the command: every rank must attach from its node's store before it loads.
        from .weight_store_client import ENV_CONFIG

        os.environ[ENV_CONFIG] = os.path.abspath(weights)
    from ..cli import main as cli

    def drive():
        # The command opens the engine itself: ENGINE is its first argument.
        cli.main([command[0], engine_dir, *command[1:]], standalone_mode=False)

    try:
        run(engine_dir, drive, device)
    except click.ClickException as e:  # the command's own error, one line as k3runtime alone prints it
        e.show()
        raise SystemExit(e.exit_code) from None
    except (click.Abort, KeyboardInterrupt):  # Ctrl-C (a bare traceback on the workers before)
        click.echo(f"\nrank {os.environ.get('RANK', '?')}: interrupted", err=True)
        raise SystemExit(130) from None
    except EngineError as e:  # on any rank (a worker finds a rank count that does not match, for one)
        click.echo(f"Error (rank {os.environ.get('RANK', '?')}): {e}", err=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    # Run the importable module, not this `__main__` copy: the engine registers its driver in the former.
    from k3runtime.dist import launch

    launch.main()
