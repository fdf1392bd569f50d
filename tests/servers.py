"""Start kvtier services as real subprocesses for tests, and wait on their health service."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789"


def child_env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env.update(KVTIER_RUN_DIR=str(run_dir), KVTIER_TOKEN=TOKEN, PYTHONUNBUFFERED="1", **extra)
    return env


def wait_serving(address: str, proc: subprocess.Popen, log_path: Path, deadline_s: float = 60.0) -> None:
    """Poll the gRPC health service until SERVING; fail fast (with the log) if the process exits."""
    target = address[len("tcp://") :] if address.startswith("tcp://") else address
    deadline = time.monotonic() + deadline_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
    proc.kill()
    raise TimeoutError(f"server at {address} not serving after {deadline_s}s:\n{log_path.read_text()[-4000:]}")


@dataclass
class Service:
    proc: subprocess.Popen
    address: str
    run_dir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextmanager
def cache_service(run_dir: Path, *args: str, env: dict[str, str] | None = None):
    """A `python -m cachesvc` subprocess on a Unix socket in `run_dir` (lease ttl 1 s unless given)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    address = f"unix://{run_dir / 'cache.sock'}"
    log_path = run_dir / "cache.log"
    argv = [sys.executable, "-m", "cachesvc", "--listen", address, *args]
    if "--lease-ttl" not in args:
        argv += ["--lease-ttl", "1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env or child_env(run_dir), stdout=log, stderr=subprocess.STDOUT)
    service = Service(proc, address, run_dir, log_path)
    try:
        wait_serving(address, proc, log_path)
        yield service
    finally:
        service.stop()
