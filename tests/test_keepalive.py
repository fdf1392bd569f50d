"""Our services let clients keep idle connections alive with pings.

Compute clients ping every connection every 5 s, also while a stream waits for data
(``kvtier.compute_client.KEEPALIVE``). A gRPC server that has not been told to accept pings that
often counts each one as abuse and, after a few, closes the connection (GOAWAY
``too_many_pings``), failing every stream on it: a Generate queued behind others for 15 s would
die for nothing. ``kvtier.grpc_server.server_options`` sets what grpc reads for that. This test
pings a real cache service every 1.5 s with no data flowing, long enough for grpc's default
tolerance (two strikes) to be used up several times over, and asserts the connection stayed up.
"""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import cache_service

from kvtier.auth import grpc_target
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
