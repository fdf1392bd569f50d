"""kvtier/cli/supervisor.py: what `kvtier up` does when a service it started exits. Real
processes (a tiny script standing for a service), real exits and signals."""

from __future__ import annotations

import signal
import time

import pytest
from servers import child_env

from kvtier.cli.stack import start
from kvtier.cli.supervisor import GiveUp, Supervisor

SCRIPT = """import sys, time
print("flaky service starting", flush=True)
time.sleep(float(sys.argv[1]))
print("flaky service giving up: no such model", flush=True)
sys.exit(3)
"""


class Stack:
    """What the supervisor uses of a stack: its processes, and record() (the stack file)."""

    def __init__(self, processes) -> None:
        self.processes = processes
        self.records = 0

    def record(self) -> None:
        self.records += 1


def service(tmp_path, lifetime_s: float):
    (tmp_path / "flaky.py").write_text(SCRIPT)
    return start(
        "flaky", "flaky", [str(lifetime_s)], "", tmp_path, child_env(tmp_path, PYTHONPATH=str(tmp_path))
    )


def steps_until(supervisor: Supervisor, done, timeout_s: float) -> list[str]:
    """Run supervisor.step() until done(lines said so far) holds; the lines."""
    said: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not done(said):
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {said}"
        said += supervisor.step()
        time.sleep(0.02)  # polling process exits with a deadline
    return said


def test_a_service_that_keeps_failing_fast_is_restarted_with_backoff_then_given_up_on(tmp_path) -> None:
    p = service(tmp_path, 0.0)
    stack = Stack([p])
    supervisor = Supervisor(stack, fast_failure_s=60.0, max_fast_failures=3, backoff_s=(0.2, 0.3))
    said: list[str] = []
    deadline = time.monotonic() + 120.0
    with pytest.raises(GiveUp) as gave_up:
        while time.monotonic() < deadline:
            said += supervisor.step()
            time.sleep(0.02)  # polling process exits with a deadline
    restarts = [line for line in said if "restarted" in line]
    waits = [line.rsplit("in ", 1)[1] for line in said if "restarting it in" in line]
    assert len(restarts) == 2 and stack.records == 2, said
    assert waits == ["0.2s", "0.3s"] and "exited (status 3)" in said[0], said  # 0.2, then 0.4 capped
    message = str(gave_up.value)
    assert "flaky exited 3 times in a row within 60s of starting (last: status 3)" in message
    assert "giving up: no such model" in message  # the end of its log says why
    assert p.log().count("flaky service starting") == 3  # one log, appended to at each restart


def test_a_killed_service_that_had_been_running_is_restarted_each_time(tmp_path) -> None:
    p = service(tmp_path, 600.0)
    stack = Stack([p])
    # Every run counts as long (fast_failure_s 0): it is restarted however often it is killed.
    supervisor = Supervisor(stack, fast_failure_s=0.0, max_fast_failures=2, backoff_s=(0.05, 1.0))
    pids = [p.proc.pid]
    try:
        for _ in range(3):
            p.proc.send_signal(signal.SIGKILL)
            said = steps_until(supervisor, lambda lines: any("restarted" in line for line in lines), 60.0)
            assert "flaky exited (killed by SIGKILL)" in said[0] and "restarting it in 0.1s" in said[0], said
            assert p.alive() and p.proc.pid not in pids
            pids.append(p.proc.pid)
        assert stack.records == 3
    finally:
        p.stop(signal.SIGKILL)
