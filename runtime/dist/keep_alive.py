"""Rank 0 keeps its idle workers waiting.

A worker waits for the driver's next step in a collective, which trips the job's timeout (K3_DIST_TIMEOUT_S) like
any other: a hung driver is then named by its stale heartbeat. But a driver with nothing to run (a server between
requests, a caller between `generate` calls, a stream its consumer paused) is not hung, so while no step has gone
out for a quarter of the timeout, this thread sends a keep-alive step, which the workers answer by waiting again.
It holds the engine's lock while it sends: a step is never cut in two by it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .comm import DistCommunicator, collective_timeout


class KeepAlive:
    def __init__(self, comm: DistCommunicator, lock: threading.Lock, can_send: Callable[[], bool]):
        """comm: the driver's communicator (its broadcast_step stamps `last_step`); lock: held around every use
        of comm by the engine (its steps, scores, shutdown); can_send: False once the engine cannot exchange
        with its workers (a failed step)."""
        self.comm, self.lock, self.can_send = comm, lock, can_send
        self.interval = max(collective_timeout().total_seconds() / 4, 0.1)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="k3-keep-alive", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from ..rank_runner import Step

        while not self._done.wait(self.interval / 2):
            # not blocking on the lock: stop() may be called by its holder, and must not wait for this thread long
            if not self.lock.acquire(timeout=self.interval / 2):
                continue
            try:
                if self._done.is_set() or not self.can_send():
                    return
                if time.monotonic() - self.comm.last_step >= self.interval:
                    self.comm.broadcast_step((Step((), keep_alive=True),))
            except Exception:  # a worker gone or hung: the engine's next step fails, and says so
                return
            finally:
                self.lock.release()

    def stop(self) -> None:
        """No keep-alive after this returns (the workers are about to be released)."""
        self._done.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
