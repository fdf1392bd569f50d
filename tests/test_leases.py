"""LeaseTable on a clock the test turns: expiry, and a stall of the service credited to every lease."""

from __future__ import annotations

import logging

import pytest

from kvtier.cachesvc.errors import LeaseExpired
from kvtier.cachesvc.leases import LeaseTable

TTL = 1.0
PERIOD = TTL / 4  # what the cache node's reaper watches with


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def run(self, seconds: float, looks: LeaseTable | None = None, step: float = PERIOD) -> None:
        """Let ``seconds`` pass; with ``looks``, the reaper looks at the table every ``step``."""
        end = self.t + seconds
        while self.t < end:
            self.t = min(self.t + step, end)
            if looks is not None:
                looks.pop_expired()


def test_a_silent_lease_expires_after_its_ttl_with_or_without_a_stall_watch():
    for watched in (False, True):
        clock = Clock()
        table = LeaseTable(TTL, clock)
        if watched:
            table.watch_stalls(PERIOD)
        lease = table.open("silent")
        clock.run(0.9, looks=table)
        assert table.get(lease.lease_id) is lease
        clock.run(0.2, looks=table)
        with pytest.raises(LeaseExpired):
            table.get(lease.lease_id)
        clock.run(TTL, looks=table)  # the release grace
        assert table.num_expired == 1 and len(table) == 0
        assert table.stalled_s == 0.0  # steady looks: nothing credited


def test_a_stall_of_the_service_is_given_back_to_every_lease(caplog):
    clock = Clock()
    table = LeaseTable(TTL, clock)
    table.watch_stalls(PERIOD)
    beating, silent = table.open("beating"), table.open("silent")
    clock.run(0.5, looks=table)
    with caplog.at_level(logging.WARNING, logger="kvtier.cachesvc.leases"):
        clock.t += 3.0  # SIGSTOP: nothing looks at the clock for three TTLs
        # The heartbeat queued in the socket meanwhile is served first, and finds its lease alive.
        table.renew(beating.lease_id)
    assert table.stalled_s == pytest.approx(3.0 - PERIOD)
    assert any("stood still for 3.00s" in r.getMessage() for r in caplog.records)
    # The silent lease had 0.5 s left before the stall; the stall past one reaper period is given
    # back, so it has 0.5 - PERIOD left, and still runs out.
    assert table.expires_in(silent) == pytest.approx(0.5 - PERIOD)
    clock.run(0.5, looks=table)
    assert [lease.client_name for lease in table] == ["beating", "silent"]  # expired, in its grace
    with pytest.raises(LeaseExpired):
        table.get(silent.lease_id)
    clock.run(2 * TTL + PERIOD, looks=table)  # the beating one stopped beating too: TTL + grace
    assert len(table) == 0 and table.num_expired == 2


def test_without_a_watch_a_gap_is_not_a_stall():
    clock = Clock()
    table = LeaseTable(TTL, clock)  # no reaper watches: unit tests, tools
    lease = table.open("a")
    clock.t += 3.0
    with pytest.raises(LeaseExpired):
        table.renew(lease.lease_id)
    assert table.stalled_s == 0.0
    with pytest.raises(ValueError, match="must be > 0"):
        table.watch_stalls(0.0)
