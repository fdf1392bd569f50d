"""Our services let clients keep idle connections alive with pings, and a client's heartbeats
outlast a service that stands still for less than its lease.

Compute clients ping every connection every 5 s, also while a stream waits for data
(``kvtier.compute_client.KEEPALIVE``). A gRPC server that has not been told to accept pings that
often counts each one as abuse and, after a few, closes the connection (GOAWAY
``too_many_pings``), failing every stream on it: a Generate queued behind others for 15 s would
die for nothing. ``kvtier.grpc_server.server_options`` sets what grpc reads for that. This test
pings a real cache service every 1.5 s with no data flowing, long enough for grpc's default
tolerance (two strikes) to be used up several times over, and asserts the connection stayed up.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import TOKEN, cache_service, wait_until

from kvtier.auth import grpc_target
from kvtier.cache_client import CHANNEL_OPTIONS, CacheClient
from kvtier.compute_client import KEEPALIVE

PING_MS = 1500  # above the server's minimum interval (1 s), far below grpc's default (5 min)
WATCH_S = 9.0  # six pings: a server rejecting them closes the connection at the third or fourth


def test_a_connection_pinged_while_idle_stays_open(tmp_path):
    options = [(k, PING_MS if k == "grpc.keepalive_time_ms" else v) for k, v in KEEPALIVE]
    with cache_service(tmp_path) as service:
        channel = grpc.insecure_channel(grpc_target(service.address), options=options)
        states: list[grpc.ChannelConnectivity] = []
        changed = threading.Condition()

        def on_state(state: grpc.ChannelConnectivity) -> None:
            with changed:
                states.append(state)
                changed.notify_all()

        try:
            channel.subscribe(on_state, try_to_connect=True)
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with changed:
                assert changed.wait_for(lambda: grpc.ChannelConnectivity.READY in states, timeout=30)
                ready_at = states.index(grpc.ChannelConnectivity.READY)
                # The test is the absence of a change for WATCH_S: wait for one, up to then.
                end = time.monotonic() + WATCH_S
                while len(states) == ready_at + 1 and (left := end - time.monotonic()) > 0:
                    changed.wait(left)
                after = states[ready_at + 1 :]
            assert after == [], f"the connection left READY while idle and pinged: {after}"
        finally:
            channel.unsubscribe(on_state)
            channel.close()


def stall(process, seconds: float) -> None:
    """SIGSTOP `process` for `seconds` (the stall being injected), then SIGCONT."""
    process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        process.send_signal(signal.SIGCONT)


@pytest.mark.parametrize(
    ("stall_s", "connect_timeout_ms"),
    [(0.6, None), (0.8, None), (0.8, 100)],
    ids=["0.6s", "0.8s", "0.8s-with-connect-attempts-timing-out-at-100ms-not-the-default"],
)
def test_a_heartbeat_on_a_fresh_channel_survives_a_stall_of_the_service_right_after_attach(
    tmp_path, stall_s, connect_timeout_ms
):
    # A replica's heartbeats go out from a client of their own (computesvc.replica._keep_lease),
    # made when it attaches. The cache service stalls (SIGSTOP, a loaded machine) right after:
    # the first heartbeat, a third of a TTL later, meets a service that does not answer. Any
    # stall shorter than the lease must cost the client nothing, whatever its attempts got.
    with cache_service(tmp_path, "--num-blocks", "16", "--lease-ttl", "1") as svc:
        # A connection of its own, as a replica's aio channel has (grpc would otherwise share
        # one connection between two channels of this process to the same address).
        own = grpc.insecure_channel(grpc_target(svc.address), options=[("grpc.use_local_subchannel_pool", 1)])
        owner = CacheClient(own, TOKEN, timeout_s=10.0)
        beats = CacheClient.connect(svc.address, TOKEN, timeout_s=0.5)  # TTL / 2, as a replica's
        if connect_timeout_ms is not None:  # its attempts fail UNAVAILABLE during the stall: retried
            options = [*CHANNEL_OPTIONS, ("grpc.min_reconnect_backoff_ms", connect_timeout_ms)]
            beats.close()
            beats = CacheClient(grpc.insecure_channel(grpc_target(svc.address), options=options), TOKEN, 0.5)
        lost: list[Exception] = []
        renewed: list[float] = []
        try:
            owner.attach("stalled")
            beats.lease_id, beats.lease_ttl_s = owner.lease_id, owner.lease_ttl_s
            stop_beating = beats.start_heartbeat_thread(renewed.append, lost.append)
            stall(svc.proc, stall_s)
            resumed = time.monotonic()
            wait_until(lambda: lost or any(t > resumed for t in renewed), 20.0, "a heartbeat after the stall")
            assert not lost, f"the client lost its lease to a {stall_s}s stall: {lost}"
            (seq,) = owner.allocate([[1, 2, 3]])  # the lease is still its own
            assert seq.sequence_id
            stop_beating.set()
        finally:
            owner.close()
            beats.close()
