"""Keeping a replica's lease alive from a thread of its own, on a channel of its own.

A replica's event loop can be busy for long stretches (a batch's sampling and detokenization, a
prompt's tokenization, the garbage collector) and its cores are shared with the model's forward
and with other processes. A heartbeat scheduled on that loop then goes out late, and under enough
load the cache service expires a lease whose replica is alive and working. The keeper sends the
heartbeats from a daemon thread over its own synchronous channel, so they wait for nothing on
the loop; every successful control call renews the lease on the service side too.

Margins (TTL = the cache service's ``--lease-ttl``, 10 s by default):
- a heartbeat every TTL/3, each with a deadline of TTL/2: two in a row can be lost or late
  before the lease runs out;
- the replica writes KV only before ``sent_at + 0.75 TTL`` of its latest successful renewal
  (``Replica._renewed``): counted from when the renewal was sent, so its deadline always falls
  before the service's expiry;
- the service refuses an expired lease at once and hands its blocks back one TTL later.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import grpc

from kvtier import status
from kvtier.cache_client import CacheClient

log = logging.getLogger("kvtier.compute")


class LeaseKeeper:
    """Renews ``lease_id`` every ``ttl_s / 3`` seconds until stopped or until the lease is lost.

    ``on_renewed(sent_at)`` is called from the keeper's thread after each successful heartbeat
    (``sent_at`` on the ``time.monotonic`` clock); ``on_lost(error)`` is called on ``loop`` when
    the service no longer knows the lease or cannot be reached. A heartbeat that only ran past
    its deadline is retried at the next beat: the replica's own write deadline fences it meanwhile.
    """

    def __init__(
        self,
        client: CacheClient,
        ttl_s: float,
        on_renewed: Callable[[float], None],
        on_lost: Callable[[Exception], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.on_renewed = on_renewed
        self.on_lost = on_lost
        self.loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-lease", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and close the keeper's channel (from the thread, once it wakes)."""
        self._stop.set()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.ttl_s / 3):
                sent_at = time.monotonic()
                try:
                    self.client.heartbeat()
                except grpc.RpcError as e:
                    lost = (
                        e.code() == grpc.StatusCode.UNAVAILABLE or status.reason_of(e) == status.LEASE_EXPIRED
                    )
                    if lost:
                        error = ConnectionError(f"heartbeat: {e.code().name}: {e.details()}")
                        self.loop.call_soon_threadsafe(self.on_lost, error)
                        return
                    log.warning(
                        "heartbeat failed (%s: %s); retrying at the next beat", e.code().name, e.details()
                    )
                    continue
                self.on_renewed(sent_at)
        finally:
            self.client.close()
