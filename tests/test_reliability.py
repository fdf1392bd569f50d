"""Faults and load against the real stack: a cache service and two compute replicas as processes
on Unix sockets, driven over real gRPC.

- a compute replica SIGKILLed under load: its requests finish on the other replica through
  ComputeClient's failover, and once its lease expires nothing stays referenced;
- the cache service SIGKILLed and restarted: requests in flight end with UNAVAILABLE within a
  deadline (none hangs), the replicas re-attach to the new pool and drop the old mapping, and
  a retry succeeds;
- a client that stops heartbeating: its lease expires, its sequences are released, and its
  later calls get NOT_FOUND naming the lease;
- a client that never reads its stream: its sequence is released when the request finishes or
  is cancelled, and the replica serves others meanwhile;
- a rolling restart (kill and restart one replica, then the other): long-lived clients lose
  no request, since a replica serves at every moment;
- 64 client processes (multiprocessing spawn) for ~20 s: no error, and the block manager's
  invariants hold during and after the load;
- a replica that loses its lease while alive (SIGSTOP past the TTL, as a starved process
  would): it stays up, and it never writes K/V into blocks the cache gave to another lease.

tests/test_compute_e2e.py pins single-stream failover and a cache kill with one request in
flight (with HF parity); these tests add concurrency, deadlines and leak accounting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from clients.generate_load import LoadSpec, collect, start_clients
from servers import TOKEN, ModuleLoop, cache_service, cache_stats, greedy_request, local_stack, wait_until

from kvtier.api import compute_pb2_grpc
from kvtier.auth import bearer, grpc_target
from kvtier.cache_client import CacheClient
from kvtier.cache_errors import CacheUnavailable
from kvtier.cli.stack import LocalStack, wait_serving
from kvtier.compute_client import ComputeClient
from kvtier.model_spec import TINY_LLAMA_CONFIG
from kvtier.pool import attach_pool

BOS = TINY_LLAMA_CONFIG["bos_token_id"]
MAX_MODEL_LEN = TINY_LLAMA_CONFIG["max_position_embeddings"]
BS = 16
LEASE_TTL_S = 2.0  # tests/servers.py local_stack's default
REPLICAS = ["compute-0", "compute-1"]  # the shared stack's lease holders
# Small enough that 64 concurrent requests wait for blocks at admission (backpressure).
# Fenced blocks of a killed or frozen replica's lease come back after 15 s, within the module.
POOL = ["--num-blocks", "128", "--swap-space", "0.01", "--fence-hold-s", "15"]

LOOP = ModuleLoop()
run = LOOP.run


def prompt(n: int, salt: int) -> list[int]:
    return [BOS, *[(salt * 37 + 11 * k) % 256 for k in range(n - 1)]]


def serves(address: str) -> bool:
    """True when the replica at `address` completes a one-token request now."""

    async def once():
        client = ComputeClient([address], TOKEN)
        try:
            await client.complete(greedy_request([BOS, 1], 1), max_attempts=1)
        finally:
            await client.close()

    try:
        run(once(), 30.0)
        return True
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False


def released_everything(stack: LocalStack):
    """GetStats once no sequence and no block is referenced (None before)."""
    s = cache_stats(stack)
    assert s.num_blocks_free + s.num_blocks_used + s.num_blocks_fenced == s.num_blocks_total
    idle = s.num_sequences == s.num_blocks_used == s.num_host_blocks_used == s.num_blocks_fenced == 0
    return s if idle else None


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory):
    with local_stack(tmp_path_factory.mktemp("reliability"), POOL, replicas=2) as s:
        yield s


@pytest.fixture
def stack(module_stack: LocalStack) -> LocalStack:
    """The shared stack with its cache and both replicas up (restarted if a test killed one)."""
    if not module_stack.cache.alive():
        module_stack.start_cache()

    def all_serve() -> bool:
        for i, replica in enumerate(module_stack.replicas):
            if not replica.alive():
                module_stack.replicas[i] = replica = module_stack.start_replica(i)
                wait_serving(replica)
            if not serves(replica.address):
                return False
        return True

    wait_until(all_serve, 90.0, "both replicas serving")
    return module_stack


# ---------------------------------------------------------------- a client that stops heartbeating


def test_client_that_stops_heartbeating_loses_its_lease_and_sequences_and_later_calls_get_not_found(tmp_path):
    with cache_service(tmp_path, "--num-blocks", "16", "--lease-ttl", "1", "--fence-hold-s", "600") as svc:
        watcher = CacheClient.connect(svc.address, TOKEN, timeout_s=5.0)
        silent = CacheClient.connect(svc.address, TOKEN, timeout_s=5.0)
        watcher.attach("watcher")
        stop_watcher = watcher.start_heartbeat_thread()
        silent.attach("silent")  # never heartbeats
        held = silent.allocate([[7] * 40, [8] * 20])
        silent.commit([(held[0].sequence_id, [], 40)])
        stats = watcher.get_stats()
        assert stats.num_sequences == 2 and stats.num_blocks_used == 3 + 2

        def expired():
            s = watcher.get_stats()
            return s if s.num_expired_leases == 1 else None

        started = time.monotonic()
        stats = wait_until(expired, 10.0, "the silent client's lease to expire")
        # Due 2.25 s in: the TTL (1 s), the release grace (one TTL), a reaper period (TTL / 4).
        # The bound leaves a loaded machine room; a reaper that never ran would take forever.
        assert time.monotonic() - started < 6.0, "released much later than TTL + grace + a reaper period"
        assert stats.num_sequences == 0 and stats.num_blocks_used == 0
        # Fencing: the blocks it might still be writing (from each sequence's first block with an
        # uncommitted slot: the third of the committed one, both of the other) stay out of reuse.
        assert stats.num_blocks_fenced == 1 + 2
        assert stats.num_blocks_free == stats.num_blocks_total - 3 == 13
        assert [lease.client_name for lease in stats.leases] == ["watcher"]
        # Its committed blocks stay cached for whoever asks next.
        assert watcher.lookup_prefix([[7] * 40])[0].num_cached_tokens == 2 * BS

        seq = held[0].sequence_id
        calls = {
            "Heartbeat": silent.heartbeat,
            "Allocate": lambda: silent.allocate([[1, 2, 3]]),
            "Extend": lambda: silent.extend([(seq, 1)]),
            "Commit": lambda: silent.commit([(seq, [], 40)]),
            "Free": lambda: silent.free([seq]),
            "SwapOut": lambda: silent.swap_out([seq]),
        }
        for name, call in calls.items():
            with pytest.raises(CacheUnavailable) as e:  # the lease is gone: attach again
                call()
            assert e.value.code == "NOT_FOUND", f"{name}: {e.value.details}"
            assert silent.lease_id[:8] in e.value.details and "Attach" in e.value.details, name
        assert comparable_counts(watcher.get_stats()) == comparable_counts(stats)

        # Attaching again opens a fresh lease that works. Naming the lost lease confirms it
        # writes no more under it: its fenced blocks are free at once.
        old = silent.lease_id
        silent.attach("silent-again", previous_lease_id=old)
        assert silent.lease_id != old
        stats = watcher.get_stats()
        assert stats.num_blocks_fenced == 0 and stats.num_blocks_free == stats.num_blocks_total == 16
        assert silent.allocate([[7] * 40])[0].num_cached_tokens == 2 * BS
        stop_watcher.set()
        watcher.close()
        silent.close()


def comparable_counts(stats) -> tuple:
    return (stats.num_sequences, stats.num_blocks_used, stats.num_blocks_free, stats.num_expired_leases)


# ---------------------------------------------------------------- a client that never reads its stream


def vm_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def replica_lease(stack: LocalStack, name: str):
    return next(lease for lease in cache_stats(stack).leases if lease.client_name == name)


def test_unread_streams_release_their_sequences_when_done_or_cancelled_and_others_are_served(stack):
    reader, canceller = stack.replicas
    rss_before = vm_rss_bytes(reader.proc.pid)
    channels = [grpc.insecure_channel(grpc_target(p.address)) for p in stack.replicas]
    try:
        stubs = [compute_pb2_grpc.ComputeServiceStub(c) for c in channels]
        # compute-0: four 600-token streams whose replies nobody reads (yet).
        opened = time.monotonic()
        unread = [
            stubs[0].Generate(greedy_request(prompt(10, 50 + k), 600), metadata=bearer(TOKEN), timeout=120)
            for k in range(4)
        ]
        # compute-1: one stream as long as the model allows, cancelled unread.
        cancelled = stubs[1].Generate(
            greedy_request(prompt(10, 60), MAX_MODEL_LEN - 10), metadata=bearer(TOKEN), timeout=120
        )
        wait_until(lambda: cache_stats(stack).num_sequences == 5, 20.0, "the five sequences allocated")

        # compute-0 serves another client meanwhile.
        started = time.monotonic()
        assert serves(reader.address)
        served_in = time.monotonic() - started

        cancelled.cancel()
        started = time.monotonic()
        wait_until(
            lambda: replica_lease(stack, canceller.name).num_sequences == 0,
            10.0,
            "the cancelled sequence released",
        )
        cancel_released_in = time.monotonic() - started
        # The unread requests run to their end on the replica and free their blocks without a read.
        stats = wait_until(lambda: released_everything(stack), 60.0, "the unread streams' sequences released")
        unread_done_in = time.monotonic() - opened
        rss_growth = vm_rss_bytes(reader.proc.pid) - rss_before
        for stream in unread:
            replies = list(stream)  # all of it was waiting for us
            assert replies[-1].finish_reason == "length"
            assert sum(len(r.token_ids) for r in replies) == 600
    finally:
        for c in channels:
            c.close()
    print(
        f"another client served in {served_in:.2f}s; cancelled stream released in "
        f"{cancel_released_in:.2f}s; unread 600-token streams done in {unread_done_in:.1f}s; "
        f"replica RSS grew {rss_growth / 2**20:.1f} MiB"
    )
    assert stats.num_blocks_free == stats.num_blocks_total
    # Decoding 1014 tokens takes longer than 600: the release came from the cancel, not the end.
    assert cancel_released_in < unread_done_in / 2, "the cancel did not release the sequence early"
    # At most 4 x 600 small replies wait in buffers: memory stays bounded.
    assert rss_growth < 64 << 20, f"the replica grew by {rss_growth / 2**20:.0f} MiB for 4 unread streams"


# ---------------------------------------------------------------- a replica SIGKILLed under load


async def complete_many(addresses: list[str], requests, max_attempts: int | None = None) -> list:
    """Complete `requests` concurrently, one ComputeClient each; results or exceptions, in order."""

    async def one(k: int, request):
        client = ComputeClient(addresses[k % 2 :] + addresses[: k % 2], TOKEN)
        try:
            return await client.complete(request, max_attempts)
        finally:
            await client.close()

    return await asyncio.gather(*(one(k, r) for k, r in enumerate(requests)), return_exceptions=True)


def test_replica_sigkilled_under_load_its_requests_finish_elsewhere_and_nothing_leaks(stack, caplog):
    before = cache_stats(stack)
    victim = stack.replicas[0]
    requests = [greedy_request(prompt(24 + k, 100 + k), 60, request_id=f"kill-{k}") for k in range(16)]

    async def load_and_kill():
        work = asyncio.ensure_future(complete_many(stack.compute_addresses, requests))
        # Kill once the victim is decoding for several of them.
        while (await asyncio.to_thread(cache_stats, stack)).num_sequences < 8 and not work.done():
            await asyncio.sleep(0.02)
        victim.proc.send_signal(signal.SIGKILL)
        return await work

    with caplog.at_level(logging.WARNING, logger="kvtier.client"):
        results = run(load_and_kill(), 120.0)
    victim.proc.wait(10)
    failovers = [r for r in caplog.records if "retrying on another" in r.getMessage()]
    assert failovers, "no request was in flight on the killed replica"
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of 16 requests failed: {errors[:3]}"
    assert all(r.finish_reason == "length" and len(r.token_ids) == 60 for r in results)

    # The survivor alone gives the same greedy tokens for every request, failed over or not.
    again = run(complete_many([stack.replicas[1].address] * 2, requests, max_attempts=1), 120.0)
    assert [r.token_ids for r in again] == [r.token_ids for r in results]

    stats = wait_until(
        lambda: released_everything(stack),
        4 * LEASE_TTL_S + 30,
        "the dead replica's blocks released (and unfenced)",
    )
    assert stats.num_expired_leases == before.num_expired_leases + 1
    assert sorted(lease.client_name for lease in stats.leases) == ["compute-1"]


def test_rolling_restart_of_both_replicas_fails_no_request_of_long_lived_clients(stack, caplog):
    """Kill compute-0, restart it, then kill compute-1: one replica serves at every moment, so
    clients that keep their ComputeClient (as a real service does) must lose no request."""
    caplog.set_level(logging.ERROR, logger="kvtier.client")  # one failover warning per retry: noise here
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()

    async def user(k: int) -> None:
        client = ComputeClient(stack.compute_addresses[k % 2 :] + stack.compute_addresses[: k % 2], TOKEN)
        first: list[int] | None = None
        try:
            while not stop.is_set():
                try:
                    done = await asyncio.wait_for(
                        client.complete(greedy_request(prompt(20, 500 + k), 8)), 30.0
                    )
                except grpc.aio.AioRpcError as e:
                    outcomes[e.code().name] += 1
                    await asyncio.sleep(0.1)
                    continue
                first = first or done.token_ids
                outcomes["OK" if done.token_ids == first else "WRONG_TOKENS"] += 1
        finally:
            await client.close()

    def restart(i: int) -> float:
        stack.replicas[i].stop(signal.SIGKILL)
        started = time.monotonic()
        stack.replicas[i] = stack.start_replica(i)
        wait_serving(stack.replicas[i])
        return time.monotonic() - started

    async def roll() -> list[float]:
        users = [asyncio.ensure_future(user(k)) for k in range(6)]
        try:
            await asyncio.sleep(1.0)
            downtimes = [await asyncio.to_thread(restart, 0), await asyncio.to_thread(restart, 1)]
            await asyncio.sleep(1.0)
        finally:
            stop.set()
            await asyncio.gather(*users)
        return downtimes

    downtimes = run(roll(), 240.0)
    print(f"rolling restart: downtimes {[f'{d:.1f}s' for d in downtimes]}, outcomes {dict(outcomes)}")
    assert outcomes["OK"] > 0
    assert set(outcomes) == {"OK"}, (
        f"requests failed although a replica was serving at every moment: {dict(outcomes)} (a client's "
        "channel to the restarted replica stays in gRPC reconnect backoff after the replica is back)"
    )


# ---------------------------------------------------------------- the cache service SIGKILLed and restarted


def replica_maps(pid: int, shm_name: str) -> bool:
    return shm_name in Path(f"/proc/{pid}/maps").read_text()


def test_cache_sigkilled_fails_requests_in_flight_fast_and_replicas_reattach_to_the_new_pool(stack):
    old = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=5.0)
    old_segment = old.attach("probe").pool.shm_name
    old.close()
    for replica in stack.replicas:
        assert replica_maps(replica.proc.pid, old_segment)
    requests = [greedy_request(prompt(20, 200 + k), 400, request_id=f"cache-kill-{k}") for k in range(8)]

    async def load_and_kill():
        work = asyncio.ensure_future(complete_many(stack.compute_addresses, requests))
        while (await asyncio.to_thread(cache_stats, stack)).num_sequences < 8 and not work.done():
            await asyncio.sleep(0.02)
        stack.cache.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        results = await work
        return results, time.monotonic() - killed_at

    results, ended_after = run(load_and_kill(), 60.0)
    stack.cache.proc.wait(10)
    codes = Counter(
        r.code().name if isinstance(r, grpc.aio.AioRpcError) else type(r).__name__ for r in results
    )
    assert codes == {"UNAVAILABLE": 8}, f"requests in flight ended with {codes}: {results[:2]}"
    assert all("cache service" in r.details() for r in results)
    assert ended_after < 10.0, f"requests in flight took {ended_after:.1f}s to fail after the cache died"

    # While the cache is down, a new request fails fast too (no hang).
    started = time.monotonic()
    (down,) = run(complete_many(stack.compute_addresses, [greedy_request(prompt(20, 299), 4)]), 30.0)
    assert isinstance(down, grpc.aio.AioRpcError) and down.code() == grpc.StatusCode.UNAVAILABLE, down
    assert time.monotonic() - started < 10.0

    stack.start_cache()  # same socket and flags: a new, empty pool
    for replica in stack.replicas:
        wait_until(lambda a=replica.address: serves(a), 60.0, f"{replica.name} re-attached")
    new = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=5.0)
    new_segment = new.attach("probe").pool.shm_name
    stats = new.get_stats()
    new.close()
    assert new_segment != old_segment
    assert sorted(lease.client_name for lease in stats.leases) == ["compute-0", "compute-1", "probe"]
    assert not Path("/dev/shm", old_segment).exists(), "the killed cache service's segment was left behind"
    for replica in stack.replicas:
        assert replica_maps(replica.proc.pid, new_segment)
        wait_until(
            lambda pid=replica.proc.pid: not replica_maps(pid, old_segment),
            10.0,
            f"{replica.name} to unmap the dead cache's segment {old_segment}",
        )

    # Retrying the failed requests now succeeds, with the same greedy tokens on either replica.
    retried = run(complete_many(stack.compute_addresses, requests), 120.0)
    assert all(not isinstance(r, BaseException) and len(r.token_ids) == 400 for r in retried), retried[:2]
    again = run(complete_many(stack.compute_addresses[::-1], requests[:2]), 120.0)
    assert [r.token_ids for r in again] == [r.token_ids for r in retried[:2]]
    wait_until(lambda: released_everything(stack), 10.0, "the retried requests' blocks released")


# ---------------------------------------------------------------- 64 client processes


class StatsSampler:
    """Reads GetStats every `period_s` from a thread and records invariant violations."""

    def __init__(self, address: str, period_s: float = 0.25):
        self.client = CacheClient.connect(address, TOKEN, timeout_s=5.0)
        self.period_s = period_s
        self.samples = 0
        self.max_used = 0
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            s = self.client.get_stats()
            self.samples += 1
            self.max_used = max(self.max_used, s.num_blocks_used)
            if s.num_blocks_free + s.num_blocks_used + s.num_blocks_fenced != s.num_blocks_total:
                self.violations.append(
                    f"free {s.num_blocks_free} + used {s.num_blocks_used} + fenced {s.num_blocks_fenced} "
                    f"!= {s.num_blocks_total}"
                )
            if not 0 <= s.num_blocks_used <= s.num_blocks_total:
                self.violations.append(f"used {s.num_blocks_used} outside [0, {s.num_blocks_total}]")
            if s.num_host_blocks_used > s.num_host_blocks_total:
                self.violations.append(f"host used {s.num_host_blocks_used} > {s.num_host_blocks_total}")
            if sum(lease.num_sequences for lease in s.leases) != s.num_sequences:
                self.violations.append("per-lease sequences do not add up to num_sequences")

    def __enter__(self) -> StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()


@contextlib.contextmanager
def cpu_burners(n: int):
    """`n` processes that spin on the CPU, as other work on a shared machine does."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield burners
    finally:
        for p in burners:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_64_client_processes_for_20s_beside_two_cpu_burners_get_no_errors_and_keep_their_leases(stack):
    # The replicas' heartbeats run on their own thread and channel, and every control call renews
    # the lease, so a replica whose cores are saturated (its model, 64 clients, two spinning
    # processes) keeps its lease; the run also leaves the block manager consistent.
    num_clients, duration_s = 64, 20.0
    spec = LoadSpec(stack.compute_addresses, TOKEN, duration_s)
    # A lease an earlier test left to run out (its "probe" client closed without renewing) must
    # be gone before the count is taken: its expiry is not the load's doing.
    before = wait_until(
        lambda: (s := cache_stats(stack)) and sorted(x.client_name for x in s.leases) == REPLICAS and s,
        30.0,
        "the leases of earlier tests' clients to run out",
    )
    ctx = multiprocessing.get_context("spawn")
    procs, go, results = start_clients(ctx, spec, num_clients)
    with StatsSampler(stack.cache_address) as sampler, cpu_burners(2):
        started = time.monotonic()
        go.set()
        out = collect(procs, results, duration_s + 2 * spec.request_timeout_s)
        elapsed = time.monotonic() - started
    served = sum(r["served"] for r in out)
    errors = Counter()
    for r in out:
        errors.update(r["errors"])
    print(
        f"{num_clients} clients x {duration_s:.0f}s: {served} requests served in {elapsed:.1f}s "
        f"({served / elapsed:.0f}/s), errors {dict(errors)}, peak {sampler.max_used}/"
        f"{before.num_blocks_total} blocks, {sampler.samples} stats samples"
    )
    unintended = {k: v for k, v in errors.items() if k != "RESOURCE_EXHAUSTED"}
    assert not unintended, (
        f"errors: {unintended}; first: {[r['first_error'] for r in out if r['first_error']][:3]}"
    )
    assert len(out) == num_clients and all(r["served"] > 0 for r in out), "a client was starved"
    assert sampler.samples > 10 and not sampler.violations, sampler.violations[:5]
    # Every prompt shares a 32-token system prefix: all but the first wave of requests hit it.
    assert sum(r["cached_prompt_tokens"] for r in out) >= 2 * BS * (served - num_clients)

    stats = wait_until(lambda: released_everything(stack), 40.0, "every sequence released after the load")
    assert stats.num_blocks_free == stats.num_blocks_total
    assert sorted(lease.client_name for lease in stats.leases) == REPLICAS
    assert all(
        lease.num_sequences == lease.num_blocks == lease.num_host_blocks == 0 for lease in stats.leases
    )
    assert stats.num_expired_leases == before.num_expired_leases, "a replica lost its lease under load"


# ---------------------------------------------------------------- a replica that loses its lease while alive
# A replica frozen (SIGSTOP: a long GC pause, a starved or descheduled VM) for longer than its
# lease TTL loses its lease while it still holds requests; the soak saw live replicas lose
# theirs under CPU starvation. These tests come last: a replica they break is restarted.


def test_a_pool_mapping_dropped_while_its_tensor_is_in_use_stays_mapped():
    # What Replica._adopt does on re-attach: replace its pool, while the old model runner (and a
    # step in flight in the executor) still holds a tensor view of the old mapping.
    code = """
import gc
from kvtier.pool import ShmPool, pool_shape
owner = ShmPool.create(pool_shape(64, 2, 16, 2, 16), "float32")
mapped = ShmPool.attach(owner.spec)
view = mapped.tensor
del mapped
gc.collect()
view.fill_(1.0)
print(float(view.sum()))
owner.close()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"touching a tensor view after its ShmPool was dropped killed the process (exit {result.returncode}"
        f"{', SIGSEGV' if result.returncode == -signal.SIGSEGV else ''}): the mapping was unmapped under a "
        f"live view\n{result.stderr[-2000:]}"
    )
    assert float(result.stdout.split()[-1]) == 64 * 2 * 2 * 16 * 2 * 16


def test_a_replica_that_loses_its_lease_mid_decode_stays_up_and_serves_again(stack):
    replica = stack.replicas[0]
    requests = [greedy_request(prompt(4, 400 + k), MAX_MODEL_LEN - 4) for k in range(24)]
    for cycle in range(5):
        expired_before = cache_stats(stack).num_expired_leases
        with grpc.insecure_channel(grpc_target(replica.address)) as channel:
            stub = compute_pb2_grpc.ComputeServiceStub(channel)
            streams = [stub.Generate(r, metadata=bearer(TOKEN), timeout=120) for r in requests]
            for stream in streams:
                next(stream)  # all 24 decoding
            replica.proc.send_signal(signal.SIGSTOP)
            try:
                wait_until(
                    lambda n=expired_before: cache_stats(stack).num_expired_leases > n,
                    4 * LEASE_TTL_S,
                    "lease expiry",
                )
            finally:
                replica.proc.send_signal(signal.SIGCONT)
            for stream in streams:
                with pytest.raises(grpc.RpcError) as e:
                    list(stream)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        wait_until(
            lambda: not replica.alive() or serves(replica.address),
            30.0,
            f"cycle {cycle}: {replica.name} back",
        )
        assert replica.alive(), (
            f"cycle {cycle}: {replica.name} died (exit {replica.proc.returncode}) after losing its lease "
            f"mid-decode; its log ends:\n{replica.log()[-1500:]}"
        )
        # It re-attached naming its lost lease: the blocks fenced for it are free again at once,
        # not after the module's 15 s --fence-hold-s.
        assert cache_stats(stack).num_blocks_fenced == 0


def test_a_replica_paused_past_its_lease_starts_no_write_into_blocks_given_to_another_lease(stack):
    """A replica frozen (SIGSTOP: a long GC pause, a starved or descheduled VM) for longer than
    its lease TTL loses its lease, and the cache hands its blocks to others. When it wakes up it
    must not write K/V into them: only the holder of a live lease may write a block (fencing)."""
    paused = stack.replicas[0]
    owner = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=10.0)
    owner.attach("new-owner")
    stop_beating = owner.start_heartbeat_thread()
    channel = grpc.insecure_channel(grpc_target(paused.address))
    seqs = []
    pool = None
    try:
        stream = compute_pb2_grpc.ComputeServiceStub(channel).Generate(
            greedy_request(prompt(10, 70), MAX_MODEL_LEN - 10), metadata=bearer(TOKEN), timeout=120
        )
        assert next(stream).token_ids, "no first token"  # the prompt is prefilled: decoding runs
        expired_before = cache_stats(stack).num_expired_leases
        paused.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(
                lambda: cache_stats(stack).num_expired_leases > expired_before,
                4 * LEASE_TTL_S,
                "the lease expiry",
            )
            # The blocks it may still be writing are fenced; take every free block (its committed
            # ones among them) and mark it.
            assert cache_stats(stack).num_blocks_fenced >= 1, "the paused lease's open blocks are not fenced"
            free = cache_stats(stack).num_blocks_free
            per_seq = MAX_MODEL_LEN // BS
            lengths = [per_seq] * (free // per_seq) + ([free % per_seq] if free % per_seq else [])
            seqs = list(owner.allocate([[1] * (n * BS) for n in lengths]))
            mine = sorted(b for seq in seqs for b in seq.block_table)
            assert len(mine) == free and cache_stats(stack).num_blocks_free == 0
            pool = attach_pool(owner.pool)
            pool.tensor[mine] = 7.0
        finally:
            paused.proc.send_signal(signal.SIGCONT)
        # The woken replica finds its lease gone, fails the request and re-attaches.
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        wait_until(
            lambda: any(lease.client_name == paused.name for lease in cache_stats(stack).leases),
            20.0,
            "re-attach",
        )
        # block -> token offsets within it whose K/V changed
        overwritten = {
            b: (pool.tensor[b] != 7.0).transpose(0, 2).reshape(BS, -1).any(dim=1).nonzero().flatten().tolist()
            for b in mine
            if not bool((pool.tensor[b] == 7.0).all())
        }
    finally:
        channel.close()
        if pool is not None:
            pool.close()
        if seqs:
            owner.free([seq.sequence_id for seq in seqs])
        stop_beating.set()
        owner.close()
    # NOTE: what fencing guarantees: no write *starts* after the lease deadline (checked before
    # every layer's write), and a write already running when the process froze (plain stores
    # into shared memory, which nothing can revoke) lands in a block the cache fenced: it holds
    # an uncommitted slot, so it is not reused for --fence-hold-s after the lease's release.
    touched = sum(len(offsets) for offsets in overwritten.values())
    assert touched == 0, (
        f"the replica woke up after its lease expired and wrote K/V into blocks {overwritten} "
        "(block: token offsets) that the cache had given to another lease"
    )
