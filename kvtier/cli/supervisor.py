"""`kvtier up` keeps what it started serving: a service that exits is started again, with backoff,
while the rest keep serving (replicas re-attach to a restarted cache service, the gateway's
router resyncs with it, a restarted replica attaches as a new one).

A service that exits within ``fast_failure_s`` of starting has failed *fast*; its restarts wait
``backoff_s[0]``, doubling up to ``backoff_s[1]``. After ``max_fast_failures`` fast failures in
a row it is not restarted: `GiveUp` says which service, how it exited and the end of its log, and
`kvtier up` stops the stack. One that ran longer than that is restarted after the first wait.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.cli.stack import Process

FAST_FAILURE_S = 15.0  # an exit this soon after a start is a fast failure (seconds)
MAX_FAST_FAILURES = 5  # fast failures in a row before giving up
BACKOFF_S = (0.5, 8.0)  # first and largest wait before a restart (seconds)


class GiveUp(Exception):
    """A service keeps failing as soon as it starts; the message says which and why."""


@dataclass
class _Watch:
    started_at: float
    fast_failures: int = 0
    restart_at: float | None = None  # set while a restart waits out its backoff


def exit_status(code: int | None) -> str:
    """A process's return code in words: 'status 3', 'killed by SIGKILL'."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"


class Supervisor:
    """Restarts the exited processes of ``stack`` (anything with ``processes`` and ``record()``,
    which rewrites its stack file with the new pids). Call ``step()`` now and then."""

    def __init__(
        self,
        stack,
        fast_failure_s: float = FAST_FAILURE_S,
        max_fast_failures: int = MAX_FAST_FAILURES,
        backoff_s: tuple[float, float] = BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stack = stack
        self.fast_failure_s = fast_failure_s
        self.max_fast_failures = max_fast_failures
        self.backoff_s = backoff_s
        self._clock = clock
        self._watches = {id(p): _Watch(clock()) for p in stack.processes}

    def step(self) -> list[str]:
        """Notice exits and restart what is due; returns a line for each thing done. Raises
        GiveUp when a service failed fast ``max_fast_failures`` times in a row."""
        now = self._clock()
        said: list[str] = []
        restarted = False
        for p in self.stack.processes:
            watch = self._watches.setdefault(id(p), _Watch(now))
            if p.alive():
                continue
            if watch.restart_at is None:
                said.append(self._exited(p, watch, now))
            elif now >= watch.restart_at:
                p.restart()
                watch.started_at, watch.restart_at = now, None
                said.append(f"{p.name} restarted (pid {p.proc.pid})")
                restarted = True
        if restarted:
            self.stack.record()
        return said

    def _exited(self, p: Process, watch: _Watch, now: float) -> str:
        """Count the exit just noticed and schedule the restart (or give up)."""
        lived = now - watch.started_at
        status = exit_status(p.proc.returncode)
        fast = lived < self.fast_failure_s
        watch.fast_failures = watch.fast_failures + 1 if fast else 0
        if watch.fast_failures >= self.max_fast_failures:
            tail = "\n".join(p.log().splitlines()[-20:])
            raise GiveUp(
                f"{p.name} exited {watch.fast_failures} times in a row within {self.fast_failure_s:.0f}s "
                f"of starting (last: {status}); not restarting it. The end of {p.log_path}:\n{tail}"
            )
        first, most = self.backoff_s
        wait = min(first * 2 ** max(0, watch.fast_failures - 1), most)
        watch.restart_at = now + wait
        return f"{p.name} exited ({status}) after {lived:.1f}s; restarting it in {wait:.1f}s"
