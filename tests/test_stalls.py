"""Short stalls (SIGSTOP, a loaded machine) of a real process cost no request and no lease.

One cache service and one compute replica as processes on Unix sockets. A stall shorter than
the lease allows must be invisible to users: a replica whose cache service stands still right
after it attached keeps its lease and finishes its requests, and a fresh client's first request
to a replica that stands still is served once it moves again (the connection waits for the
replica's HTTP/2 SETTINGS instead of giving up after 100 ms).
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from servers import TOKEN, ModuleLoop, greedy_request, local_stack, wait_until

from kvtier.api import compute_pb2_grpc
from kvtier.auth import bearer, grpc_target
from kvtier.compute_client import ComputeClient

pytestmark = [pytest.mark.timeout(300)]

LOOP = ModuleLoop()
LEASE_TTL_S = 3.0  # the first heartbeat goes out a third of it after attaching (before the fix)
STALL_S = 1.5  # half the lease


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stalls")
    with local_stack(run_dir, ["--num-blocks", "64", "--lease-ttl", str(LEASE_TTL_S)], [], 1) as s:
        yield s


def prompt(n: int = 40) -> list[int]:
    return [1 + (j * 13) % 250 for j in range(n)]


def test_a_stall_of_the_cache_service_right_after_a_replica_attaches_costs_no_request(stack):
    replica = stack.replicas[0]
    replica.stop()
    started, attached = replica.log().count("serving on"), replica.log().count("attached to")
    replica.restart()
    # The replica attached, then began serving: stall its cache service at once, across the
    # replica's first heartbeats, while a request is in flight.
    wait_until(lambda: replica.log().count("serving on") > started, 120.0, "the restarted replica serving")
    stack.cache.proc.send_signal(signal.SIGSTOP)
    try:
        channel = grpc.insecure_channel(grpc_target(replica.address))
        stream = compute_pb2_grpc.ComputeServiceStub(channel).Generate(
            greedy_request(prompt(), 64), metadata=bearer(TOKEN), timeout=120
        )
        time.sleep(STALL_S)  # the stall being injected
    finally:
        stack.cache.proc.send_signal(signal.SIGCONT)
    try:
        tokens = [t for reply in stream for t in reply.token_ids]  # one attempt: no failover
    finally:
        channel.close()
    assert len(tokens) == 64
    # It kept the lease it attached with: no re-attach.
    assert "lost the cache service" not in replica.log(), replica.log()[-2000:]
    assert replica.log().count("attached to") == attached + 1, replica.log()[-2000:]


def test_a_fresh_clients_first_request_to_a_replica_that_stands_still_is_served(stack):
    replica = stack.replicas[0]
    wait_until(lambda: "serving on" in replica.log(), 120.0, "the replica serving")

    async def first_request_during_a_stall():
        client = ComputeClient(stack.compute_addresses, TOKEN)
        replica.proc.send_signal(signal.SIGSTOP)
        try:
            request = asyncio.ensure_future(client.complete(greedy_request(prompt(24), 8)))
            await asyncio.sleep(STALL_S)  # the stall being injected
        finally:
            replica.proc.send_signal(signal.SIGCONT)
        try:
            return await request
        finally:
            await client.close()

    done = LOOP.run(first_request_during_a_stall(), 120)
    assert done.finish_reason == "length" and len(done.token_ids) == 8
