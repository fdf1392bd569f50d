"""Fenced blocks: what an expired lease's writer may still write, held back from reuse.

A replica that lost its lease may be frozen inside a KV write (a long GC pause, SIGSTOP);
handing the blocks it was writing to someone else at once would let that late write corrupt
them. So when a lease expires, ``SequenceTable.free_lease`` hands this class each device
sequence's blocks from its first uncommitted slot on; they stay referenced here until a
deadline (``--fence-hold-s``) or until the holder re-attaches naming the lost lease. Committed
blocks are never written again and are released at once (their content stays cached).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.cachesvc.block_manager import BlockManager


class Fencing:
    """Blocks of expired leases held (still referenced in ``block_manager``) until a deadline."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        # (release time on the caller's clock, block ids, lease id), oldest first.
        self.fenced: list[tuple[float, list[int], str]] = []

    def hold(self, until: float, block_ids: list[int], lease_id: str) -> None:
        """Keep ``block_ids`` (referenced, charged to no one) until ``until``."""
        if block_ids:
            self.fenced.append((until, block_ids, lease_id))

    @property
    def num_fenced_blocks(self) -> int:
        return sum(len(ids) for _, ids, _ in self.fenced)

    def block_lists(self) -> list[list[int]]:
        """The held block ids, one list per hold (the block manager's invariants count them)."""
        return [ids for _, ids, _ in self.fenced]

    def release_fenced(self, now: float) -> int:
        """Free the fenced blocks whose time is up; returns how many."""
        released = 0
        while self.fenced and self.fenced[0][0] <= now:
            _, ids, _ = self.fenced.pop(0)
            released += len(ids)
            self.block_manager.free(ids[::-1])
        return released

    def release_fenced_of(self, lease_id: str) -> int:
        """Free the fenced blocks of ``lease_id`` now (its holder confirmed it writes no more)."""
        mine = [entry for entry in self.fenced if entry[2] == lease_id]
        for entry in mine:
            self.fenced.remove(entry)
            self.block_manager.free(entry[1][::-1])
        return sum(len(ids) for _, ids, _ in mine)
