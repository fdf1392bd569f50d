"""The stack file (``run_dir/stack.json``): what a running local stack records about itself (its
addresses, model, gateway, each process's pid and Prometheus URL), and what other processes do
with it: find a serving stack (`kvtier generate`, `kvtier serve`) and stop one from another shell
(`kvtier down`)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from kvtier.auth import check_private_dir
from kvtier.healthcheck import check

if TYPE_CHECKING:
    from kvtier.cli.stack import LocalStack, MultiNodeStack, Process

STACK_FILE = "stack.json"
METRICS_URL = re.compile(r"Prometheus metrics on (http://\S+/metrics)")


def metrics_url(p: Process) -> str | None:
    """Where `p` serves Prometheus metrics: the URL a service logs at startup (with --metrics-port),
    or the gateway's own /metrics; None if it serves none."""
    if p.name.startswith("gateway"):
        return f"{p.address}/metrics" if p.address else None
    m = METRICS_URL.search(p.log())
    return m.group(1) if m else None


def write_stack_file(
    stack: LocalStack | MultiNodeStack, pids: dict[str, int], nodes: list[dict] | None = None
) -> None:
    """The stack file in the stack's run dir: its addresses, model, gateway, and each service's
    pid, so `kvtier down` can stop them even if the process that started them was killed."""
    info: dict = {
        "cache": stack.cache_address,
        "compute": stack.compute_addresses,
        "pid": os.getpid(),
        "pids": pids,
    }
    # Each process's Prometheus endpoint, under the same name as its pid.
    metrics = {name: url for name, p in zip(pids, stack.processes, strict=True) if (url := metrics_url(p))}
    if metrics:
        info["metrics"] = metrics
    if nodes:
        info["nodes"] = nodes
    if stack.model:
        info["model"] = stack.model
    if stack.gateway:
        info["gateway"] = stack.gateway.address
    # Atomic: `kvtier down`, `kvtier stats` and tests read it while a restart rewrites it.
    tmp = stack.run_dir / f".{STACK_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, stack.run_dir / STACK_FILE)


def stop_stack(run_dir: Path, timeout_s: float = 30.0) -> list[str]:
    """Stop the stack recorded in run_dir's stack file; returns the names of what was stopped.

    The process that started the stack (`kvtier up`) gets SIGTERM and stops its services itself.
    A service it left behind (it was SIGKILLed) gets SIGTERM directly, but only if its command
    line still names this run directory: a recorded pid may have been reused by another process.
    """
    path = run_dir / STACK_FILE
    if not path.is_file():
        return []
    check_private_dir(run_dir)  # another user's stack file would name pids of their choosing
    info = json.loads(path.read_text())
    stopped: list[str] = []
    owner = info.get("pid")
    if owner and owner != os.getpid() and _signal_if_ours(owner, "kvtier", signal.SIGTERM):
        stopped.append(f"kvtier up (pid {owner})")
        _wait_gone(owner, timeout_s)
    for name, pid in info.get("pids", {}).items():
        if _signal_if_ours(pid, str(run_dir), signal.SIGTERM):
            stopped.append(f"{name} (pid {pid})")
            _wait_gone(pid, timeout_s)
    path.unlink(missing_ok=True)
    return stopped


def _signal_if_ours(pid: int, marker: str, sig: int) -> bool:
    """Send `sig` to `pid` if it is alive and its command line contains `marker` (a recorded pid
    may have been reused by an unrelated process)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False  # gone
    if marker not in cmdline:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pid: int, timeout_s: float) -> None:
    """Wait until `pid` has exited (a zombie waiting for its parent counts as exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state == "Z":
            return
        time.sleep(0.05)  # polling another process's exit with a deadline


def recorded_stack(run_dir: Path) -> dict | None:
    """What run_dir's stack file says (None without one), whether or not it still serves.

    auth.UntrustedPath if run_dir is not private to us."""
    path = run_dir / STACK_FILE
    if not path.is_file():
        return None
    check_private_dir(run_dir)
    return json.loads(path.read_text())


def running_stack(run_dir: Path) -> dict | None:
    """The addresses of a stack `kvtier up` started in run_dir, if it is serving.

    auth.UntrustedPath if run_dir is not private to us: a stack file there could send our token
    to another user's sockets."""
    info = recorded_stack(run_dir)
    if info is None:
        return None
    try:
        if all(check(a, timeout_s=1.0) == "SERVING" for a in [info["cache"], *info["compute"]]):
            return info
    except grpc.RpcError:
        pass
    return None
