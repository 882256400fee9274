"""Rank 0 keeps its idle workers waiting.

A worker waits for the driver's next step in a collective, which trips the job's timeout (K3_DIST_TIMEOUT_S) like
any other: a hung driver is then named by its stale heartbeat. But a driver with nothing to run (a server between
requests, a caller between `generate` calls, a stream its consumer paused) is not hung, so while no step has gone
out for a quarter of the timeout, this thread sends a keep-alive step, which the workers answer by waiting again.
It holds the engine's lock while it sends: a step is never cut in two by it. A keep-alive that fails (a worker
gone, or hung past the timeout) is reported at once (on_error): an idle engine must not look alive until its next
step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .comm import DistCommunicator, collective_timeout


class KeepAlive:
    def __init__(self, comm: DistCommunicator, lock: threading.Lock, can_send: Callable[[], bool],
                 on_error: Callable[[BaseException], None] | None = None):
        """comm: the driver's communicator (its broadcast_step stamps `last_step`); lock: held around every use
        of comm by the engine (its steps, scores, shutdown); can_send: False once the engine cannot exchange
        with its workers (a failed step); on_error: called (with the lock held) with the error of a keep-alive
        that failed."""
        self.comm, self.lock, self.can_send, self.on_error = comm, lock, can_send, on_error
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
            except Exception as e:  # a worker gone or hung: the engine can step no more; it says so now
                if self.on_error is not None:
                    self.on_error(e)
                return
            finally:
                self.lock.release()

    def stop(self) -> None:
        """No keep-alive after this returns (the workers are about to be released)."""
        self._done.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
