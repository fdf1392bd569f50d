"""Start the local stack (one cache service, N compute replicas) as processes, and stop it.

Used by `kvtier up` / `kvtier demo`, by the tests and by the benchmarks: every service is a
real process on a Unix socket in one run directory, ready once its gRPC health service says
SERVING.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvtier.healthcheck import check

STACK_FILE = "stack.json"


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    address: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_serving(p: Process, deadline_s: float = 120.0) -> None:
    """Poll the health service until SERVING; fail fast, with the log, if the process exits."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not p.alive():
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.log()[-4000:]}")
        try:
            if check(p.address, timeout_s=1.0) == "SERVING":
                return
        except grpc.RpcError:
            time.sleep(0.05)  # not up yet: the socket does not exist or refuses
    p.stop(signal.SIGKILL)
    raise TimeoutError(f"{p.name} at {p.address} not serving after {deadline_s:.0f}s:\n{p.log()[-4000:]}")


def start(
    name: str, module: str, args: list[str], address: str, run_dir: Path, env: dict[str, str]
) -> Process:
    """Start `python -m module args` with its output in run_dir/name.log (not yet waited on)."""
    log_path = run_dir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in a terminal reaches the CLI, which stops us cleanly
        )
    return Process(name, proc, address, log_path)


@dataclass
class LocalStack:
    run_dir: Path
    cache_args: list[str] = field(default_factory=list)
    compute_args: list[str] = field(default_factory=list)
    num_replicas: int = 2
    env: dict[str, str] | None = None
    cache: Process | None = None
    replicas: list[Process] = field(default_factory=list)

    @property
    def cache_address(self) -> str:
        return f"unix://{self.run_dir / 'cache.sock'}"

    def replica_address(self, i: int) -> str:
        return f"unix://{self.run_dir / f'compute-{i}.sock'}"

    @property
    def compute_addresses(self) -> list[str]:
        return [p.address for p in self.replicas]

    def _env(self) -> dict[str, str]:
        env = dict(self.env if self.env is not None else os.environ)
        env["KVTIER_RUN_DIR"] = str(self.run_dir)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def start_cache(self) -> Process:
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.cache = start(
            "cache",
            "cachesvc",
            ["--listen", self.cache_address, *self.cache_args],
            self.cache_address,
            self.run_dir,
            self._env(),
        )
        wait_serving(self.cache)
        return self.cache

    def start_replica(self, i: int) -> Process:
        address = self.replica_address(i)
        args = [
            "--cache",
            self.cache_address,
            "--listen",
            address,
            "--name",
            f"compute-{i}",
            *self.compute_args,
        ]
        return start(f"compute-{i}", "computesvc", args, address, self.run_dir, self._env())

    def up(self) -> LocalStack:
        """Start the cache service, then the replicas (in parallel), and wait until all serve."""
        try:
            self.start_cache()
            self.replicas = [self.start_replica(i) for i in range(self.num_replicas)]
            for p in self.replicas:
                wait_serving(p)
        except BaseException:
            self.down()
            raise
        (self.run_dir / STACK_FILE).write_text(
            json.dumps({"cache": self.cache_address, "compute": self.compute_addresses, "pid": os.getpid()})
        )
        return self

    def down(self) -> None:
        procs = [*self.replicas, *([self.cache] if self.cache else [])]
        for p in procs:  # signal all first: they shut down in parallel
            if p.alive():
                p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            p.stop()
        (self.run_dir / STACK_FILE).unlink(missing_ok=True)

    def __enter__(self) -> LocalStack:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def running_stack(run_dir: Path) -> dict | None:
    """The addresses of a stack `kvtier up` started in run_dir, if it is serving."""
    path = run_dir / STACK_FILE
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    try:
        if all(check(a, timeout_s=1.0) == "SERVING" for a in [info["cache"], *info["compute"]]):
            return info
    except grpc.RpcError:
        pass
    return None
