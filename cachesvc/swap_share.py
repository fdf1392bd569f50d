"""Swap space as the host cache's area (issue 22): with ``--host-cache-gib``, the swap tier a
``SequenceTable`` swaps to is the host block cache's slots, swap first (``cachesvc.host_cache``:
``take_slots`` evicts cached blocks to make room, ``release_slots`` gives them back)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.cachesvc.errors import InvalidArgument
from kvtier.cachesvc.tiers import LowerTier, TierStats

if TYPE_CHECKING:
    import torch

    from kvtier.cachesvc.host_cache import HostBlockCache


class SwapShare(LowerTier):
    """Swap space as the host cache's area, swap first (issue 22): the swap tier a SequenceTable
    swaps to when ``--host-cache-gib`` is on. Its slots are ``cache``'s: ``allocate`` takes them
    with ``take_slots`` (evicting cached blocks, LRU first, on to the disk if there is one),
    ``release`` gives them back; copies move whole rows of ``pool_rows`` (``[num_blocks,
    block_bytes]`` uint8), complete when they return."""

    name = "host"

    def __init__(self, cache: HostBlockCache, pool_rows: torch.Tensor) -> None:
        self.cache = cache
        self.pool_rows = pool_rows
        self.block_bytes = cache.block_bytes
        self.stats = TierStats()

    @property
    def num_blocks(self) -> int:
        return self.cache.num_slots

    @property
    def num_free_blocks(self) -> int:
        """Slots swap can take now: every slot not swap's already (cached ones are evicted)."""
        return self.cache.num_slots - self.cache.num_swap_slots

    def used_slots(self) -> list[int]:
        """Swap's slots, ascending (for the invariants)."""
        return self.cache.swap_slot_ids()

    def allocate(self, num_blocks: int) -> list[int]:
        return self.cache.take_slots(num_blocks)

    def release(self, ids: list[int]) -> None:
        self.cache.release_slots(ids)

    def store(self, device_ids: list[int], ids: list[int]) -> None:
        self.cache.area.copy_in(ids, [self.pool_rows[i] for i in device_ids])

    def load(self, ids: list[int], device_ids: list[int]) -> None:
        if len(ids) != len(device_ids):
            raise InvalidArgument(f"len(slots) = {len(ids)} != len(device_ids) = {len(device_ids)}")
        self.cache.area.copy_out(ids, [self.pool_rows[i] for i in device_ids])
