"""Start the local stack (one cache service, N compute replicas, optionally the HTTP gateway) as
processes, and stop it.

Used by `kvtier up` / `kvtier demo`, by the tests and by the benchmarks: every service is a
real process on a Unix socket in one run directory, ready once its gRPC health service says
SERVING; the gateway listens on TCP and is ready once its GET /health answers 200. The stack file
a started stack writes, and finding or stopping a stack from another process: kvtier.cli.stack_file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvtier.auth import create_token_file, ensure_run_dir
from kvtier.cli.stack_file import STACK_FILE, write_stack_file
from kvtier.cpu_plan import allocator_libs, preload_env
from kvtier.healthcheck import check

# Each service's own trace name (as in docker-compose.yml and deploy/k8s): the one the caller's
# OTEL_SERVICE_NAME (`kvtier generate`'s, a test client's) would otherwise give every process.
SERVICE_NAMES = {"cachesvc": "kvtier-cache", "computesvc": "kvtier-compute", "gateway": "kvtier-gateway"}
SERVICE_MODULES = {name: f"kvtier.{name}" for name in SERVICE_NAMES}  # what `python -m` runs


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    address: str
    log_path: Path
    command: list[str] = field(default_factory=list)  # what `restart` runs again
    env: dict[str, str] | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def restart(self) -> None:
        """Run the process's command again (it has exited), its output appended to the same log.
        A gateway keeps the port it got: the URL `kvtier up` printed stays right."""
        command = list(self.command)
        if self.address.startswith("http://") and "--port" in command:
            command[command.index("--port") + 1] = self.address.rsplit(":", 1)[1].split("/")[0]
        self.proc = _popen(command, self.env or {}, self.log_path, "a")

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
    """Start `python -m MODULE args` with its output in run_dir/name.log (not yet waited on); a
    service's name (cachesvc, computesvc, gateway) runs its kvtier module."""
    log_path = run_dir / f"{name}.log"
    command = [sys.executable, "-m", SERVICE_MODULES.get(module, module), *args]
    env = {**env, "OTEL_SERVICE_NAME": SERVICE_NAMES.get(module, module)}
    if module == "computesvc":  # tcmalloc where installed (kvtier.cpu_plan)
        env = preload_env(env, allocator_libs())
    return Process(name, _popen(command, env, log_path, "w"), address, log_path, command, env)


def _popen(command: list[str], env: dict[str, str], log_path: Path, mode: str) -> subprocess.Popen:
    with open(log_path, mode) as log:
        return subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in a terminal reaches the CLI, which stops us cleanly
        )


GATEWAY_URL = re.compile(r"serving the OpenAI API on (http://\S+)")


def spawn_gateway(
    compute: list[str], args: list[str], run_dir: Path, env: dict[str, str], port: int = 0
) -> Process:
    """Start `python -m kvtier.gateway` in front of `compute` on 127.0.0.1:port (0 = a free one); not
    yet waited on (`wait_gateway`). Its Process.address becomes the base URL once it listens."""
    argv = ["--host", "127.0.0.1", "--port", str(port), "--compute", *compute, *args]
    return start("gateway", "gateway", argv, "", run_dir, env)


def wait_gateway(p: Process, deadline_s: float = 180.0, ready_path: str = "/health") -> Process:
    """Wait until the gateway's GET `ready_path` answers 200 (/health: a replica serves behind it;
    /version: the gateway itself is up)."""
    deadline = time.monotonic() + deadline_s
    try:
        while not p.address:  # the URL (the port chosen) is in the startup line of its log
            _check_alive(p, deadline, deadline_s)
            if m := GATEWAY_URL.search(p.log()):
                p.address = m.group(1)
            else:
                time.sleep(0.05)
        wait_http(p, ready_path, deadline - time.monotonic())
    except BaseException:
        p.stop(signal.SIGKILL)
        raise
    return p


def start_gateway(
    compute: list[str],
    args: list[str],
    run_dir: Path,
    env: dict[str, str],
    port: int = 0,
    ready_path: str = "/health",
) -> Process:
    """`spawn_gateway` and `wait_gateway`."""
    return wait_gateway(spawn_gateway(compute, args, run_dir, env, port), ready_path=ready_path)


def wait_http(p: Process, path: str, deadline_s: float) -> None:
    """Poll GET p.address + path until it answers 200; fail fast, with the log, if the process exits."""
    deadline = time.monotonic() + deadline_s
    while True:
        _check_alive(p, deadline, deadline_s)
        try:
            with urllib.request.urlopen(p.address + path, timeout=2.0) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)  # not listening yet, or no replica serving yet (503)


def _check_alive(p: Process, deadline: float, deadline_s: float) -> None:
    if not p.alive():
        raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.log()[-4000:]}")
    if time.monotonic() > deadline:
        raise TimeoutError(f"{p.name} not ready after {deadline_s:.0f}s:\n{p.log()[-4000:]}")


@dataclass
class LocalStack:
    run_dir: Path
    cache_args: list[str] = field(default_factory=list)
    compute_args: list[str] = field(default_factory=list)
    num_replicas: int = 2
    env: dict[str, str] | None = None
    # The HTTP gateway: started after the replicas when gateway_args is not None.
    gateway_args: list[str] | None = None
    gateway_port: int = 8000
    model: str | None = None  # recorded in the stack file, for clients that need the tokenizer
    cache: Process | None = None
    replicas: list[Process] = field(default_factory=list)
    gateway: Process | None = None

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

    def spawn_cache(self) -> Process:
        """Start the cache service (not yet waited on: `wait_serving(stack.cache)`)."""
        ensure_run_dir(self.run_dir)  # 0700 if new; another user's, or writable by others: refused
        self.cache = start(
            "cache",
            "cachesvc",
            ["--listen", self.cache_address, *self.cache_args],
            self.cache_address,
            self.run_dir,
            self._env(),
        )
        return self.cache

    def start_cache(self) -> Process:
        wait_serving(self.spawn_cache())
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

    def spawn_servers(self) -> None:
        """Start the replicas and the gateway, once the cache service serves (not yet waited on)."""
        self.replicas = [self.start_replica(i) for i in range(self.num_replicas)]
        if self.gateway_args is not None:  # it loads its tokenizer while the replicas load the model
            self.gateway = spawn_gateway(
                self.compute_addresses, self.gateway_args, self.run_dir, self._env(), self.gateway_port
            )

    def wait_servers(self) -> None:
        for p in self.replicas:
            wait_serving(p)
        if self.gateway is not None:
            wait_gateway(self.gateway)

    def up(self) -> LocalStack:
        """Start the cache service, then the replicas and the gateway (in parallel), and wait until all serve."""
        up_side_by_side([self])
        return self

    @property
    def processes(self) -> list[Process]:
        return [p for p in [self.cache, *self.replicas, self.gateway] if p is not None]

    def record(self) -> None:
        """(Re)write the stack file: addresses and every process's pid (after a restart too)."""
        write_stack_file(self, {p.name: p.proc.pid for p in self.processes})

    def down(self) -> None:
        procs = [
            *([self.gateway] if self.gateway else []),
            *self.replicas,
            *([self.cache] if self.cache else []),
        ]
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


def up_side_by_side(stacks: list[LocalStack]) -> None:
    """Start several stacks at once, each as `LocalStack.up` does: every cache service, then, once
    they all serve, every stack's replicas and gateway, and wait until all serve. If any fails to
    start, every stack is stopped and the error raised."""
    try:
        for stack in stacks:
            stack.spawn_cache()
        for stack in stacks:
            wait_serving(stack.cache)
        for stack in stacks:
            stack.spawn_servers()
        for stack in stacks:
            stack.wait_servers()
    except BaseException:
        for stack in stacks:
            stack.down()
        raise
    for stack in stacks:
        stack.record()


@dataclass
class MultiNodeStack:
    """`kvtier up --nodes N`: N nodes, each a LocalStack (its own cache service and pool, standing
    for one accelerator, and its replicas) in ``run_dir/node-i``, and one gateway in ``run_dir``
    routing across them (gateway/router.py). Every process uses the one token in ``run_dir``."""

    run_dir: Path
    num_nodes: int
    cache_args: list[str] = field(default_factory=list)
    compute_args: list[str] = field(default_factory=list)
    num_replicas: int = 2
    env: dict[str, str] | None = None
    gateway_args: list[str] | None = None
    gateway_port: int = 8000
    model: str | None = None
    shared_tier_gib: float = 0.0  # > 0: a Mooncake Store of this many GiB beside the nodes (shared tier)
    nodes: list[LocalStack] = field(default_factory=list)
    gateway: Process | None = None
    store: object | None = None  # kvtier.cli.store_master.StoreMaster, with shared_tier_gib

    def _env(self) -> dict[str, str]:
        env = dict(self.env if self.env is not None else os.environ)
        env["KVTIER_RUN_DIR"] = str(self.run_dir)
        if "KVTIER_TOKEN" not in env and "KVTIER_TOKEN_FILE" not in env:
            token_file = self.run_dir / "token"
            if not token_file.exists():
                create_token_file(token_file)
            env["KVTIER_TOKEN_FILE"] = str(token_file)
        return env

    @property
    def cache_address(self) -> str:
        return self.nodes[0].cache_address

    @property
    def compute_addresses(self) -> list[str]:
        return [a for node in self.nodes for a in node.compute_addresses]

    def node_flags(self) -> list[str]:
        """The gateway's --node flags for these nodes."""
        flags: list[str] = []
        for i, node in enumerate(self.nodes):
            flags += ["--node", f"node-{i}@{node.cache_address}={','.join(node.compute_addresses)}"]
        return flags

    def up(self) -> MultiNodeStack:
        ensure_run_dir(self.run_dir)
        env = self._env()
        cache_args = self.cache_args
        if self.shared_tier_gib:  # the store first: every node's cache service points at it
            from kvtier.cli.store_master import StoreMaster

            # The cache's tenant file (the api-keys file) names the store's tenants: strict mode.
            at = cache_args.index("--tenant-quotas") + 1 if "--tenant-quotas" in cache_args else 0
            keys = cache_args[at] if at else None
            self.store = StoreMaster(self.run_dir, self.shared_tier_gib, env=env, api_keys=keys).up()
            cache_args = [*cache_args, *self.store.node_flags()]
        self.nodes = [
            LocalStack(
                self.run_dir / f"node-{i}",
                cache_args,
                self.compute_args,
                self.num_replicas,
                env,
                model=self.model,
            )
            for i in range(self.num_nodes)
        ]
        try:
            up_side_by_side(self.nodes)  # the nodes start in parallel
            for node in self.nodes:
                (node.run_dir / STACK_FILE).unlink(missing_ok=True)  # the stack file is the parent's
            if self.gateway_args is not None:
                self.gateway = wait_gateway(
                    start(
                        "gateway",
                        "gateway",
                        [
                            "--host",
                            "127.0.0.1",
                            "--port",
                            str(self.gateway_port),
                            *self.node_flags(),
                            *self.gateway_args,
                        ],
                        "",
                        self.run_dir,
                        env,
                    )
                )
        except BaseException:
            self.down()
            raise
        self.record()
        return self

    def record(self) -> None:
        """(Re)write the stack file: every node, and every process's pid (after a restart too)."""
        nodes = [
            {"name": f"node-{i}", "cache": n.cache_address, "compute": n.compute_addresses}
            for i, n in enumerate(self.nodes)
        ]
        write_stack_file(
            self, {f"{p.name}@{p.address or 'gateway'}": p.proc.pid for p in self.processes}, nodes
        )

    @property
    def processes(self) -> list[Process]:
        store = self.store.processes if self.store is not None else []
        nodes = [p for node in self.nodes for p in node.processes]
        return [*store, *nodes, *([self.gateway] if self.gateway else [])]

    def down(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for node in self.nodes:
            node.down()
        if self.store is not None:
            self.store.down()
        (self.run_dir / STACK_FILE).unlink(missing_ok=True)

    def __enter__(self) -> MultiNodeStack:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
