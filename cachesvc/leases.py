"""Leases: every sequence belongs to one, and a lease that stops heartbeating expires.

Expiry itself only reports which leases ran out; the caller (``CacheNode``'s reaper) releases
their sequences through the sequence table, so committed blocks stay in the prefix cache.

A stall of the cache service itself (SIGSTOP, a VM pause, a loop blocked) is not its clients'
fault: their heartbeats wait in its socket meanwhile. Once a reaper looks at the clock at a
steady period (``watch_stalls``), a gap between two looks longer than twice that period is the
service standing still, and the time past one period is given back to every lease: the table's
clock (``now``) is the monotonic clock less every stall so far, and lease times are on it.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.cachesvc.errors import InvalidArgument, LeaseExpired

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Lease:
    lease_id: str
    client_name: str
    expires_at: float  # on the table's clock (``LeaseTable.now``: monotonic seconds less stalls)


class LeaseTable:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self.release_grace_s = ttl_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0
        # Stall credit (module docstring): off until a reaper watches the clock.
        self._period_s: float | None = None
        self._last_look = 0.0
        self.stalled_s = 0.0  # time given back to every lease so far

    def watch_stalls(self, period_s: float) -> None:
        """The caller looks at the clock (``now``) at least every ``period_s`` seconds while this
        process runs: a longer gap (over twice the period) is a stall, credited to every lease."""
        if period_s <= 0:
            raise ValueError(f"stall watch period must be > 0 seconds, got {period_s}")
        self._period_s = period_s
        self._last_look = self.clock()

    def now(self) -> float:
        """The table's clock: ``clock()`` less every stall of this process seen so far."""
        t = self.clock()
        if self._period_s is not None:
            gap = t - self._last_look
            self._last_look = t
            if gap > 2 * self._period_s:
                credit = gap - self._period_s
                self.stalled_s += credit
                log.warning(
                    "the cache service stood still for %.2fs (SIGSTOP, a VM pause or a blocked loop): "
                    "%.2fs given back to every lease, whose heartbeats could not be served meanwhile",
                    gap,
                    credit,
                )
        return t - self.stalled_s

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self):
        return iter(list(self._leases.values()))

    def open(self, client_name: str) -> Lease:
        # NOTE: the lease id is a 128-bit secret: holding it is what lets a client touch its sequences.
        lease = Lease(secrets.token_hex(16), client_name, self.now() + self.ttl_s)
        self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease:
        if not lease_id:
            raise InvalidArgument("lease_id is empty: call Attach first and pass the lease it returns")
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= self.now():
            raise LeaseExpired(f"lease {lease_id[:8]}… is unknown or expired: call Attach again")
        return lease

    def renew(self, lease_id: str) -> Lease:
        return self.touch(self.get(lease_id))

    def touch(self, lease: Lease) -> Lease:
        """A full TTL from now for a live ``lease`` (from ``get``)."""
        lease.expires_at = self.now() + self.ttl_s
        return lease

    def expires_in(self, lease: Lease) -> float:
        return max(0.0, lease.expires_at - self.now())

    def pop(self, lease_id: str) -> Lease | None:
        """Remove ``lease_id`` whether or not it ran out (its holder gave it up); None if unknown."""
        return self._leases.pop(lease_id, None)

    def pop_expired(self) -> list[Lease]:
        """Remove and return the leases whose time ran out at least one grace period ago.

        NOTE: an expired lease is refused at once (`get`), but its blocks are handed back only a
        TTL later. A client that stalled past its lease stops writing by its own deadline (which
        runs out before ours); the grace covers the step it may have had in flight.
        """
        now = self.now() - self.release_grace_s
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.lease_id]
        self.num_expired += len(expired)
        return expired
