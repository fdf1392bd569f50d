"""Releasing the blocks a sliding window has left behind (Extend's ``releases``, issue 24).

When every attention layer of a model has a sliding window, the blocks wholly before the window
of a sequence's next query are never read again. The compute replica, which knows the windows,
names them on the Extend it makes anyway (``ReleaseItem``: "the blocks before index N"); the
cache service needs no model knowledge. A released block is dropped as at Free: only committed
blocks may be released and those are published, so it goes to the LRU tail and stays a prefix
hit for later requests until it is evicted. The table keeps its positions: released entries
become ``PLACEHOLDER_BLOCK`` and ``num_released_blocks`` counts them, so every walk over a
sequence's held blocks reads ``Sequence.live_blocks`` (Free, SwapOut, the limits, the invariants).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.cachesvc.records import PLACEHOLDER_BLOCK
from kvtier.cachesvc.validation import release_sequences

if TYPE_CHECKING:
    from kvtier.cachesvc.block_manager import BlockManager
    from kvtier.cachesvc.limits import TenantLimits
    from kvtier.cachesvc.records import CacheStats, Sequence
    from kvtier.sequence_types import CommitItem, ReleaseItem


class Releasing:
    """Extend's releases over a table's records (``sequences``), block manager and limits;
    counted in ``stats.num_window_released_blocks``."""

    def __init__(
        self,
        sequences: dict[int, Sequence],
        block_manager: BlockManager,
        limits: TenantLimits,
        stats: CacheStats,
        max_batch: int,
    ) -> None:
        self.sequences = sequences
        self.block_manager = block_manager
        self.limits = limits
        self.stats = stats
        self.max_batch = max_batch

    def check(
        self, lease_id: str, releases: list[ReleaseItem], commits: list[CommitItem] = ()
    ) -> list[tuple[Sequence, int]]:
        """The ``(sequence, num_blocks)`` to release, after checking every item against the
        records as the call's ``commits`` (checked already) leave them. Changes nothing."""
        if not releases:
            return []
        bs = self.block_manager.block_size
        return release_sequences(self.sequences, bs, self.max_batch, lease_id, releases, commits)

    def apply(self, releases: list[tuple[Sequence, int]]) -> int:
        """Release blocks ``[num_released_blocks, num_blocks)`` of each ``(sequence, num_blocks)``
        from ``check``; returns how many blocks reached no holder."""
        freed = 0
        limits = self.limits
        for seq, num_blocks in releases:
            start = seq.num_released_blocks
            table = seq.block_table
            # Reversed, as Free does: the later blocks of the run are evicted before the earlier.
            freed += self.block_manager.free(table[start:num_blocks][::-1])
            table[start:num_blocks] = [PLACEHOLDER_BLOCK] * (num_blocks - start)
            seq.num_released_blocks = num_blocks
            seq.cached_blocks = None  # the handed-out table changed
            if limits.limited:
                limits.charge(seq.tenant, seq.lease_id, start - num_blocks)
            self.stats.num_window_released_blocks += num_blocks - start
        return freed
