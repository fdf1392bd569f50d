"""The cache service's domain as one object: sequences, leases and the event log, one method per RPC.

``CacheNode`` checks the lease a call names, runs the call on the sequence table and logs the
block events it caused; the servicer only converts protobuf to these calls and back. No gRPC
here. Everything runs on the server's single asyncio loop, so calls never interleave and
nothing needs a lock.
"""

from __future__ import annotations

import asyncio
import logging

from kvtier.cachesvc.errors import FailedPrecondition, InvalidArgument
from kvtier.cachesvc.events import EventLog
from kvtier.cachesvc.leases import Lease, LeaseTable
from kvtier.cachesvc.records import DEVICE
from kvtier.cachesvc.sequences import SequenceTable
from kvtier.sequence_types import (  # the snapshot types are GetStats' reply, shared with its clients
    AllocateItem,
    CacheSnapshot,
    CommitItem,
    ExtendItem,
    LeaseSnapshot,
    PrefixQuery,
    SequenceBlocks,
    TenantSnapshot,
    TierSnapshot,
)

log = logging.getLogger("kvtier.cache")


def tier_snapshots(seqs: SequenceTable) -> list[TierSnapshot]:
    """The device tier, then the lower tiers (if any). A lower-tier hit is a promotion, so the
    device's own hits are Allocate's hit blocks minus the blocks promoted into it."""
    bm, lower = seqs.block_manager, seqs.lower_tiers
    block_bytes = lower.pool_rows.shape[1] if lower is not None else seqs.device.block_bytes
    rows = [TierSnapshot(**row) for row in lower.tier_rows()] if lower is not None else []
    promoted = sum(row.num_promotions for row in rows)
    for row in rows:
        row.num_hit_blocks = row.num_promotions
    device = TierSnapshot(
        "device",
        bm.num_cached_blocks,
        bm.num_cached_blocks * block_bytes,
        num_hit_blocks=seqs.stats.prefix_hit_tokens // bm.block_size - promoted,
        num_promotions=promoted,
        num_evictions=bm.num_evictions,
    )
    return [device, *rows]


def _nonempty(field: str, values: list) -> list:
    if not values:
        raise InvalidArgument(f"{field} is empty: a call carries at least one sequence")
    return values


class CacheNode:
    """One cache service's state: ``sequences`` over the pool, ``leases``, and ``events``.

    Every call that names a lease checks it first (InvalidArgument if empty, LeaseExpired if
    unknown or expired), then its items; a failing call changes nothing. Block events a call
    causes are in ``events`` when it returns.
    """

    def __init__(
        self,
        sequences: SequenceTable,
        leases: LeaseTable,
        fence_hold_s: float = 120.0,
        event_log_events: int = 65536,
    ) -> None:
        """``fence_hold_s``: how long past its release an expired lease's unwritten blocks stay
        fenced (see ``release_expired_leases``); ``event_log_events``: the newest events the log
        keeps (``--event-log-events``)."""
        self.sequences = sequences
        self.leases = leases
        self.fence_hold_s = fence_hold_s
        self.events = EventLog(sequences.block_size, event_log_events)
        self._logged(None)  # what the tiers announced as they opened (the disk tier's records)

    def _logged(self, result):
        """``result``, after moving the block manager's new event records into the log."""
        records = self.sequences.block_manager.take_event_records()
        lower = self.sequences.lower_tiers
        if lower is not None:  # the host and disk tiers' events, after the device's
            shared = lower.by_name.get("shared")
            if shared is not None and shared.write_through and records:  # published blocks, to the store now
                shared.write_published(records, lower.pool_rows, self.sequences.block_manager.block_tenants)
            records += lower.take_event_records()
        self.events.extend(records)
        return result

    def _succeeded(self, lease: Lease, result):
        """``result`` of a call that succeeded under ``lease``: the call renews the lease (its
        client is evidently alive, even if a heartbeat is late) and its events are logged."""
        self.leases.touch(lease)
        return self._logged(result)

    # ------------------------------------------------------------ leases

    def attach(self, client_name: str, model_fingerprint: str = "", previous_lease_id: str = "") -> Lease:
        """Open a lease for ``client_name``; a non-empty ``model_fingerprint`` must be the pool's.

        ``previous_lease_id``: a lease the client held and lost, named once no write under it can
        happen: its sequences (if not released yet) are released now without fencing, and its
        fenced blocks are freed now. An unknown id is ignored (it may be long gone)."""
        ours = self.sequences.model_fingerprint
        if model_fingerprint and model_fingerprint != ours:
            raise FailedPrecondition(
                f"model fingerprint {model_fingerprint[:12]}… does not match the pool's "
                f"{ours[:12]}…: start compute with the cache service's model"
            )
        if previous_lease_id:
            self._unfence(previous_lease_id)
        lease = self.leases.open(client_name)
        log.info("lease %s… opened by %s", lease.lease_id[:8], lease.client_name)
        return lease

    def _unfence(self, lease_id: str) -> None:
        """Release what fencing holds of ``lease_id``: its holder confirmed it writes no more."""
        seqs = self.sequences
        released = 0
        if self.leases.pop(lease_id) is not None:
            released = seqs.free_lease(lease_id)
        freed = seqs.fencing.release_fenced_of(lease_id)
        if released or freed:
            log.info(
                "lease %s… given up by its holder: %d blocks released, %d fenced blocks freed",
                lease_id[:8],
                released,
                freed,
            )
        self._logged(None)

    def heartbeat(self, lease_id: str) -> float:
        """Renew a lease; returns the seconds it now has left."""
        return self.leases.expires_in(self.leases.renew(lease_id))

    def release_expired_leases(self) -> int:
        """Release the sequences of every expired lease; returns how many leases expired.

        Fencing: a replica frozen inside a KV write (SIGSTOP, a VM pause) may finish that write
        whenever it wakes, long after its lease ran out. The blocks it could be writing (from
        each sequence's first block with an uncommitted slot on) are therefore not reused at
        once but held for ``fence_hold_s``; committed blocks go back (still cached) at once.
        Fenced blocks whose time is up are freed here too.
        """
        seqs = self.sequences
        expired = self.leases.pop_expired()
        now = self.leases.clock()
        for lease in expired:
            fenced_before = seqs.fencing.num_fenced_blocks
            released = seqs.free_lease(lease.lease_id, fence_until=now + self.fence_hold_s)
            log.warning(
                "lease %s… of %s expired: released its sequences (%d blocks back to the free queue, "
                "%d fenced for %.0fs)",
                lease.lease_id[:8],
                lease.client_name,
                released,
                seqs.fencing.num_fenced_blocks - fenced_before,
                self.fence_hold_s,
            )
        unfenced = seqs.fencing.release_fenced(now)
        if unfenced:
            log.info("%d fenced blocks of expired leases are free again", unfenced)
        return self._logged(len(expired))

    async def reap_leases_forever(self) -> None:
        # NOTE: leases are also checked lazily on every call, so this only bounds how long a dead
        # client's blocks stay referenced: at most a quarter TTL past expiry. Its steady looks at
        # the clock are what lets the lease table tell a stall of this process (credited to every
        # lease: cachesvc.leases) from clients that went quiet.
        period_s = self.leases.ttl_s / 4
        self.leases.watch_stalls(period_s)
        while True:
            await asyncio.sleep(period_s)
            self.release_expired_leases()

    # ------------------------------------------------------------ sequences

    def allocate(self, lease_id: str, items: list[AllocateItem]) -> list[SequenceBlocks]:
        lease = self.leases.get(lease_id)
        return self._succeeded(lease, self.sequences.allocate(lease.lease_id, _nonempty("items", items)))

    def extend(
        self, lease_id: str, items: list[ExtendItem], commits: list[CommitItem] = (), releases=()
    ) -> list[SequenceBlocks]:
        """Per ``(sequence_id, num_tokens)``: room for that many tokens more, after ``commits``
        and ``releases`` (ReleaseItems: blocks a sliding window left behind)."""
        lease = self.leases.get(lease_id)
        return self._succeeded(
            lease, self.sequences.extend(lease.lease_id, _nonempty("items", items), commits, releases)
        )

    def commit(self, lease_id: str, items: list[CommitItem]) -> int:
        """Per ``(sequence_id, new_token_ids, num_computed_tokens)``; returns blocks published."""
        lease = self.leases.get(lease_id)
        return self._succeeded(lease, self.sequences.commit(lease.lease_id, _nonempty("items", items)))

    def free(self, lease_id: str, sequence_ids: list[int], commits: list[CommitItem] = ()) -> int:
        """Returns the device blocks released (after ``commits``)."""
        lease = self.leases.get(lease_id)
        return self._succeeded(
            lease, self.sequences.free(lease.lease_id, _nonempty("sequence_ids", sequence_ids), commits)
        )

    def lookup_prefix(self, items: list[PrefixQuery], below: list | None = None) -> list[int]:
        """Per prompt: leading tokens cached on the device (``below``: see
        ``SequenceTable.lookup_prefix``). Needs no lease."""
        return self.sequences.lookup_prefix(_nonempty("items", items), below)

    def swap_out(
        self, lease_id: str, sequence_ids: list[int], commits: list[CommitItem] = ()
    ) -> tuple[int, int]:
        """Returns ``(blocks, bytes)`` copied to the host tier (after ``commits``)."""
        lease = self.leases.get(lease_id)
        return self._succeeded(
            lease, self.sequences.swap_out(lease.lease_id, _nonempty("sequence_ids", sequence_ids), commits)
        )

    def swap_in(self, lease_id: str, sequence_ids: list[int]) -> tuple[list[SequenceBlocks], int, int]:
        """Returns the sequences' new blocks and ``(blocks, bytes)`` copied back to the device."""
        lease = self.leases.get(lease_id)
        return self._succeeded(
            lease, self.sequences.swap_in(lease.lease_id, _nonempty("sequence_ids", sequence_ids))
        )

    # ------------------------------------------------------------ observation

    def held_blocks(self) -> tuple[int, list[tuple[str, list[bytes]]]]:
        """The newest event's id and, as of it, the index keys each medium holds (the device's
        published blocks, then each lower tier's ``held_now``; of a medium shared across nodes, those
        this node knows the store holds): what a follower that applied every event up to it holds."""
        self._logged(None)  # the tiers' events so far are in the log, numbered before the id
        media = [(DEVICE, list(self.sequences.block_manager.prefix_index))]
        lower = self.sequences.lower_tiers
        if lower is not None:
            media += [(t.medium.name, t.held_now()) for t in lower.tiers]
        return self.events.last_event_id, media

    def snapshot(self) -> CacheSnapshot:
        """The numbers GetStats reports and the metrics export. O(sequences + leases)."""
        seqs = self.sequences
        bm = seqs.block_manager
        host = seqs.host_area
        stats = seqs.stats
        leases: list[LeaseSnapshot] = []
        num_tokens = num_token_slots = 0
        for lease in self.leases:
            own = seqs.sequences_of(lease.lease_id)
            on_device = [s for s in own if s.location == DEVICE]
            lease_blocks = sum(s.num_blocks for s in on_device)
            # Tokens in the blocks held: a sliding window's released blocks hold none.
            lease_tokens = sum(len(s.token_ids) - s.num_released_blocks * bm.block_size for s in on_device)
            num_tokens += lease_tokens
            num_token_slots += lease_blocks * bm.block_size
            leases.append(
                LeaseSnapshot(
                    lease_id=lease.lease_id[:8],
                    client_name=lease.client_name,
                    num_sequences=len(own),
                    num_blocks=lease_blocks,
                    num_host_blocks=sum(len(s.tier_slots) for s in own),
                    expires_in_s=self.leases.expires_in(lease),
                    num_tokens=lease_tokens,
                )
            )
        return CacheSnapshot(
            num_blocks_total=bm.num_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_used=bm.num_used_blocks - seqs.fencing.num_fenced_blocks,
            num_blocks_cached=bm.num_cached_blocks,
            usage_percent=100.0 * bm.num_used_blocks / bm.num_blocks,
            prefix_query_tokens=stats.prefix_query_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            num_evictions=bm.num_evictions,
            num_host_blocks_total=host.num_blocks if host else 0,
            num_host_blocks_used=host.num_used_blocks if host else 0,
            num_swap_out_blocks=stats.num_swap_out_blocks,
            num_swap_in_blocks=stats.num_swap_in_blocks,
            num_swap_out_bytes=stats.num_swap_out_bytes,
            num_swap_in_bytes=stats.num_swap_in_bytes,
            num_sequences=len(seqs),
            num_swapped_sequences=seqs.num_swapped_sequences,
            leases=leases,
            block_size=bm.block_size,
            num_expired_leases=self.leases.num_expired,
            num_tokens=num_tokens,
            num_token_slots=num_token_slots,
            tenants=[TenantSnapshot(t, *usage) for t, usage in sorted(seqs.limits.tenant_usage().items())],
            max_blocks_per_lease=seqs.limits.max_blocks_per_lease,
            num_blocks_fenced=seqs.fencing.num_fenced_blocks,
            num_window_released_blocks=stats.num_window_released_blocks,
            tiers=tier_snapshots(seqs),
        )
