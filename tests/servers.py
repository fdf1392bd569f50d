"""Start kvtier services as real subprocesses for tests (through kvtier.cli.stack), each in its own run dir."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from kvtier.cache_client import CacheClient
from kvtier.cli.stack import LocalStack, Process, start
from kvtier.compute_client import ComputeClient

REPO = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789"


def child_env(run_dir: Path, **extra: str) -> dict[str, str]:
    """Our environment minus tracing and kvtier settings, plus the test token and run dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env.update(KVTIER_RUN_DIR=str(run_dir), KVTIER_TOKEN=TOKEN, PYTHONUNBUFFERED="1", **extra)
    return env


@contextmanager
def cache_service(run_dir: Path, *args: str, env: dict[str, str] | None = None):
    """A `python -m kvtier.cachesvc` subprocess on a Unix socket in `run_dir`: the defaults a user gets
    (the host cache `auto`, swap a share of it), lease ttl 1 s unless given. A test about another
    setting passes it and says so in its name."""
    args = [*args, *([] if "--lease-ttl" in args else ["--lease-ttl", "1"])]
    stack = LocalStack(run_dir, cache_args=args, num_replicas=0, env=env or child_env(run_dir))
    service: Process = stack.start_cache()
    service.run_dir = run_dir
    try:
        yield service
    finally:
        stack.down()


@contextmanager
def tls_cache_service(run_dir: Path, *args: str):
    """A cache service on TCP with TLS (a self-signed certificate for 127.0.0.1 made with openssl):
    yields (its host:port, the certificate's path, the Process)."""
    import re
    import subprocess

    key, cert = run_dir / "key.pem", run_dir / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    tls = ["--listen", "tcp://127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key)]
    proc = start("cache", "cachesvc", [*tls, *args], "", run_dir, child_env(run_dir))
    try:
        # The health probe speaks plaintext, so readiness here is the port the service logs.
        address = wait_until(
            lambda: (m := re.search(r"listening on (127\.0\.0\.1:\d+)", proc.log())) and m.group(1),
            30.0,
            "the TLS service to log its port",
        )
        yield address, cert, proc
    finally:
        proc.stop()


# The API key of the one-replica gateway stack that tests/conftest.py's `edge_gateway` shares.
EDGE_API_KEY = "sk-kvtier-edge-test"


@contextmanager
def local_stack(run_dir: Path, cache_args=(), compute_args=(), replicas: int = 2, env=None):
    """Cache service + `replicas` compute replicas, all serving, with the defaults unless given."""
    cache_args = [*cache_args, *([] if "--lease-ttl" in cache_args else ["--lease-ttl", "2"])]
    with LocalStack(
        run_dir, list(cache_args), list(compute_args), replicas, env or child_env(run_dir)
    ) as stack:
        yield stack


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str):
    """Poll `predicate` until it returns a truthy value; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.05)  # polling a state change with a deadline, not waiting for readiness


async def wait_until_async(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    """`wait_until` on the running loop (its tasks, a router's followers say, run meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        await asyncio.sleep(0.05)


class ModuleLoop:
    """One asyncio event loop for a whole test module (tests/conftest.py closes a module's `LOOP`).

    NOTE: grpc.aio binds its completion queue to the first loop it sees, and a fresh
    asyncio.run per call leaves it calling back into a closed loop.
    """

    def __init__(self) -> None:
        self._runner = asyncio.Runner()

    def run(self, coro, timeout_s: float = 120.0):
        """Run `coro` on the module's loop, failing it after `timeout_s` (no test hangs)."""
        return self._runner.run(asyncio.wait_for(coro, timeout_s))

    def complete(self, addresses: list[str], requests, max_attempts: int | None = None) -> list:
        """Send Generate `requests` one after the other through one ComputeClient (round robin
        over `addresses`); their Completions."""

        async def complete_all() -> list:
            client = ComputeClient(addresses, TOKEN)
            try:
                return [await client.complete(r, max_attempts) for r in requests]
            finally:
                await client.close()

        return self.run(complete_all())

    def close(self) -> None:
        self._runner.close()


def cache_stats(stack: LocalStack):
    """GetStats of the stack's cache service, through a short-lived client."""
    client = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=5.0)
    try:
        return client.get_stats()
    finally:
        client.close()


def disk_drained(tiers) -> bool:
    """The disk tier among GetStats' ``tiers`` has indexed every block it accepted (its write
    queue, the group being written included, is empty)."""
    return all(t.write_queue_depth == 0 for t in tiers if t.medium == "disk")


def greedy_request(token_ids: list[int], max_tokens: int, **kw):
    """A greedy Generate request that runs to `max_tokens` (EOS ignored)."""
    return ComputeClient.request(
        prompt_token_ids=token_ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw
    )


def stats_without_clock(stats):
    """A copy of a CacheSnapshot (GetStats) minus what changes with the clock alone (lease
    countdowns), for asserting that a call changed no state."""
    leases = [dataclasses.replace(lease, expires_in_s=0) for lease in stats.leases]
    return dataclasses.replace(stats, leases=leases)
