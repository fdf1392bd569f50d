"""SwapOut / SwapIn: whole sequences between the device pool and the host tier.

``Swapping`` is the part of ``SequenceTable`` these two RPCs run on (the table inherits it):
kept in its own module because it is the only sequence logic that moves KV bytes, and the
place a disk tier would plug in. Both calls are all or nothing, as every table call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachesvc.errors import ResourceExhausted
from cachesvc.records import DEVICE, HOST, CacheStats, Sequence
from cachesvc.validation import check_batch, check_unique, owned
from kvtier.sequence_types import CommitItem, SequenceBlocks

if TYPE_CHECKING:
    from cachesvc.block_manager import BlockManager
    from cachesvc.host_tier import HostTier


class Swapping:
    """``swap_out`` / ``swap_in`` of ``SequenceTable``, over the table's own state."""

    # Provided by SequenceTable, as are the _room, _blocks_of, _publish, _check_commit,
    # _apply_commit methods used here, and _contested and _check_fair_share (cachesvc.limits).
    block_manager: BlockManager
    host_tier: HostTier | None
    block_size: int
    max_batch: int
    stats: CacheStats
    _sequences: dict[int, Sequence]

    def swap_out(
        self, lease_id: str, sequence_ids: list[int], commits: list[CommitItem] = ()
    ) -> tuple[int, int]:
        """Move whole sequences to the host tier; their device blocks are freed (reverse order,
        committed ones stay cached). Returns ``(blocks, bytes)`` copied. ``commits`` are applied
        first (what the sequences computed since the last call), all or nothing.
        """
        checked = self._check_commit(lease_id, commits) if commits else []
        check_batch(len(sequence_ids), self.max_batch)
        seqs = [owned(self._sequences, lease_id, k, sid) for k, sid in enumerate(sequence_ids)]
        check_unique(sequence_ids)
        total = sum(len(seq.block_table) for seq in seqs)
        host = self.host_tier
        if host is None:
            raise ResourceExhausted("no host tier is configured (swap space 0): cannot swap out")
        if total > host.num_free_blocks:
            raise ResourceExhausted(
                f"swap out needs {total} host blocks but only {host.num_free_blocks} of "
                f"{host.num_blocks} are free"
            )
        if commits:
            self._apply_commit(checked, commits)

        device_ids = [i for seq in seqs for i in seq.block_table]
        slots = host.swap_out(device_ids)
        bm = self.block_manager
        pos = 0
        for seq in seqs:
            n = len(seq.block_table)
            seq.host_slots = slots[pos : pos + n]
            pos += n
            bm.free(seq.block_table[::-1])
            seq.block_table = []
            seq.room = 0
            seq.cached_blocks = None
            seq.location = HOST
        num_bytes = total * host.block_bytes
        self.stats.num_swap_out_blocks += total
        self.stats.num_swap_out_bytes += num_bytes
        return total, num_bytes

    def swap_in(self, lease_id: str, sequence_ids: list[int]) -> tuple[list[SequenceBlocks], int, int]:
        """Move swapped sequences back to fresh device blocks. Returns ``(blocks, num_blocks,
        num_bytes)``; ``blocks`` carry the new block tables. Committed full blocks are published again.
        """
        check_batch(len(sequence_ids), self.max_batch)
        seqs = [owned(self._sequences, lease_id, k, sid, location=HOST) for k, sid in enumerate(sequence_ids)]
        check_unique(sequence_ids)
        total = sum(len(seq.host_slots) for seq in seqs)
        bm = self.block_manager
        if self._contested():  # fair share (SequenceTable): swapping in takes device blocks too
            by_tenant: dict[str, int] = {}
            for seq in seqs:
                by_tenant[seq.tenant] = by_tenant.get(seq.tenant, 0) + len(seq.host_slots)
            self._check_fair_share(by_tenant, total)
        if total > bm.num_free_blocks:
            raise ResourceExhausted(
                f"swap in needs {total} device blocks but only {bm.num_free_blocks} of {bm.num_blocks} are free"
            )

        new_ids = bm.allocate(total)
        host = self.host_tier
        host.swap_in([s for seq in seqs for s in seq.host_slots], new_ids)
        pos = 0
        for seq in seqs:
            n = len(seq.host_slots)
            seq.block_table = new_ids[pos : pos + n]
            seq.room = self._room(seq.block_table)
            seq.cached_blocks = None
            pos += n
            seq.host_slots = []
            seq.location = DEVICE
            # The copied blocks hold committed KV: offer them to the index again (a duplicate of a
            # still-cached original is skipped by publish).
            seq.num_published_blocks = 0
            self._publish(seq, seq.num_computed_tokens // self.block_size)
        num_bytes = total * host.block_bytes
        self.stats.num_swap_in_blocks += total
        self.stats.num_swap_in_bytes += num_bytes
        return [self._blocks_of(seq) for seq in seqs], total, num_bytes
