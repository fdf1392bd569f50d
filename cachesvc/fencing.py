"""Lease expiry: a lost lease's sequences released, and the blocks its writer may still write fenced.

``Fencing`` is the part of ``SequenceTable`` (which inherits it) that runs when a lease expires
or its holder comes back. A replica that lost its lease may be frozen inside a KV write (a long
GC pause, SIGSTOP); handing the blocks it was writing to someone else at once would let that
late write corrupt them. So a lost lease's blocks from each sequence's first uncommitted slot on
are held, still referenced, until a deadline (``--fence-hold-s``) or until the holder
re-attaches naming the lost lease; committed blocks are never written again and are released
at once (their content stays cached).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachesvc.records import DEVICE

if TYPE_CHECKING:
    from cachesvc.block_manager import BlockManager


class Fencing:
    """``free_lease`` and the fenced blocks of ``SequenceTable``, over the table's own state."""

    # Provided by SequenceTable, as are its sequences_of, _release and _charge methods.
    block_manager: BlockManager
    block_size: int
    _limited: bool
    # Blocks of expired leases that a frozen writer could still be writing, held (still
    # referenced) until a deadline: (release time on the caller's clock, block ids, lease id),
    # oldest first.
    fenced: list[tuple[float, list[int], str]]

    def free_lease(self, lease_id: str, fence_until: float | None = None) -> int:
        """Release every sequence of a lease, on the device and on the host (lease expiry).

        Committed blocks stay in the prefix cache, so a retry elsewhere hits them. Returns
        device blocks released; an unknown lease releases nothing.

        With ``fence_until``, a device sequence's blocks from the first one holding an
        uncommitted slot on are not released but fenced until that time (``release_fenced``):
        a writer of the lease frozen inside a KV write can only finish it into them. Blocks
        wholly committed are never written again, so they are released at once.
        """
        fenced: list[int] = []
        released = 0
        bs = self.block_size
        for seq in self.sequences_of(lease_id):
            if fence_until is not None and seq.location == DEVICE:
                first_open = seq.num_computed_tokens // bs
                held = seq.block_table[first_open:]
                if held:  # charged to no tenant or lease while fenced
                    if self._limited:
                        self._charge(seq.tenant, seq.lease_id, -len(held))
                    seq.block_table = seq.block_table[:first_open]
                    fenced += held
            released += self._release(seq)
        if fenced:
            self.fenced.append((fence_until, fenced, lease_id))
        return released

    @property
    def num_fenced_blocks(self) -> int:
        return sum(len(ids) for _, ids, _ in self.fenced)

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
