"""Tiers: the places a block's KV can live, behind one interface.

The device pool (``DeviceTier``, over the block manager) is the tier compute reads and writes;
every other tier is a ``LowerTier`` (today the host tier, ``cachesvc.host_tier.HostTier``) that
holds whole pool blocks and copies them to and from the device pool. The contract every tier
keeps (docs/architecture.md, section 4):

- capacity is ``num_blocks`` slots of ``block_bytes`` bytes; ``num_free_blocks`` of them free;
- ``allocate(n)`` hands out ``n`` free slot ids or raises ResourceExhausted taking none;
  ``release(ids)`` gives them back (on the device: to the LRU tail, still cached if published);
- a ``LowerTier`` copies with ``store(device_ids, ids)`` (device pool -> its slots) and
  ``load(ids, device_ids)`` (its slots -> device pool); each returns once the copy is complete,
  since another process reads the pool next. Both sides' slots are allocated by the caller;
- ``copy_blocks`` is the one way blocks move between tiers, and it counts them in both tiers'
  ``TierStats``.

A sequence record names the tier its blocks are on (``Sequence.location``, a tier's ``name``).
Swapping a preempted sequence out and in (``cachesvc.swap``) is one use of this interface.
Adding a tier (a disk tier) is one ``LowerTier`` subclass and the flag that builds it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.cachesvc.errors import InvalidArgument

if TYPE_CHECKING:
    from kvtier.cachesvc.block_manager import BlockManager


@dataclass(slots=True)
class TierStats:
    """Blocks and bytes copied into and out of one tier since the service started."""

    blocks_in: int = 0
    blocks_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class Tier(ABC):
    """One place blocks live: ``num_blocks`` slots of ``block_bytes`` bytes each."""

    name: str  # what a Sequence's ``location`` holds while its blocks are here
    block_bytes: int  # bytes of one block (every layer, K and V)
    stats: TierStats

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Capacity in blocks."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now."""

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_used_bytes(self) -> int:
        return self.num_used_blocks * self.block_bytes

    @abstractmethod
    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free slot ids; ResourceExhausted, taking none, if fewer are free."""

    @abstractmethod
    def release(self, ids: list[int]) -> None:
        """Give slots back (the device pool: in the order they should enter the LRU)."""


class LowerTier(Tier):
    """A tier below the device pool: it copies whole blocks to and from the pool."""

    @abstractmethod
    def store(self, device_ids: list[int], ids: list[int]) -> None:
        """Copy pool blocks ``device_ids`` into this tier's allocated slots ``ids`` (same order)."""

    @abstractmethod
    def load(self, ids: list[int], device_ids: list[int]) -> None:
        """Copy this tier's slots ``ids`` into pool blocks ``device_ids`` (same order)."""


class DeviceTier(Tier):
    """The device pool as a tier: slots are pool blocks, handed out and taken back by the block
    manager (reference counts, LRU, prefix index). ``block_bytes`` is 0 when the table runs
    without a pool (unit tests and benchmarks of the bookkeeping alone)."""

    name = "device"

    def __init__(self, block_manager: BlockManager, block_bytes: int = 0) -> None:
        self.block_manager = block_manager
        self.block_bytes = block_bytes
        self.stats = TierStats()

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        return self.block_manager.allocate(num_blocks)

    def release(self, ids: list[int]) -> None:
        self.block_manager.free(ids)

    def on_evict(self, hook: Callable[[list[int], list[bytes]], None] | None) -> None:
        """The tiered prefix cache's hook (issue 22): ``hook(block_ids, index_keys)`` runs when
        ``allocate`` evicts published blocks, before their slots are reused (their KV is still
        in the pool), so a lower tier keeps them under their prefix-index keys (``LowerTiers.keep``;
        a key's hash is ``hash_preimage(key)``). None: nothing runs."""
        self.block_manager.on_evict = hook


def copy_blocks(src: Tier, src_ids: list[int], dst: Tier, dst_ids: list[int]) -> int:
    """Copy ``src_ids`` of ``src`` into ``dst_ids`` of ``dst`` (both allocated by the caller;
    nothing is released); returns bytes copied and counts them in both tiers' stats.

    Copies go between the device pool and a lower tier; two lower tiers exchange blocks
    through the device pool (no caller needs it yet).
    """
    if len(src_ids) != len(dst_ids):
        raise InvalidArgument(f"len(src_ids) = {len(src_ids)} != len(dst_ids) = {len(dst_ids)}")
    if isinstance(dst, LowerTier) and isinstance(src, DeviceTier):
        dst.store(src_ids, dst_ids)
    elif isinstance(src, LowerTier) and isinstance(dst, DeviceTier):
        src.load(src_ids, dst_ids)
    else:
        raise InvalidArgument(
            f"no copy from tier {src.name!r} to tier {dst.name!r}: one side must be the device"
        )
    n = len(src_ids)
    num_bytes = n * (dst.block_bytes or src.block_bytes)
    src.stats.blocks_out += n
    src.stats.bytes_out += num_bytes
    dst.stats.blocks_in += n
    dst.stats.bytes_in += num_bytes
    return num_bytes
