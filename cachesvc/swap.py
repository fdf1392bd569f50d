"""Swapping: whole sequences moved between the device tier and a lower tier, one use of the tiers.

``SequenceTable.swap_out`` / ``swap_in`` validate a call, check the limits and apply its commits;
``Swapping`` then checks the tiers' room and moves the blocks: it copies them with
``cachesvc.tiers.copy_blocks``, releases the slots they left, and updates each moved record's
location, tables and the swap counters. It reads and writes only the records it is handed, the
tiers and the counters it was built with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.cachesvc.errors import ResourceExhausted
from kvtier.cachesvc.records import PLACEHOLDER_BLOCK
from kvtier.cachesvc.tiers import DeviceTier, LowerTier, SlotTier, copy_blocks

if TYPE_CHECKING:
    from kvtier.cachesvc.records import CacheStats, Sequence


class Swapping:
    """Moves sequences' blocks between ``device`` and ``swap_tier`` (None: no swap space); counts
    them in ``stats``. Swapping in reads each record's tier from its ``location``."""

    def __init__(self, device: DeviceTier, swap_tier: LowerTier | None, stats: CacheStats) -> None:
        self.device = device
        self.swap_tier = swap_tier
        self.stats = stats
        self.tiers: dict[str, SlotTier] = {device.name: device}
        if swap_tier is not None:
            self.tiers[swap_tier.name] = swap_tier

    def check_out(self, num_blocks: int) -> LowerTier:
        """The tier ``num_blocks`` device blocks would go to; ResourceExhausted if none has room."""
        tier = self.swap_tier
        if tier is None:
            raise ResourceExhausted("no host tier is configured (swap space 0): cannot swap out")
        if num_blocks > tier.num_free_blocks:
            raise ResourceExhausted(
                f"swap out needs {num_blocks} {tier.name} blocks but only {tier.num_free_blocks} of "
                f"{tier.num_blocks} are free"
            )
        return tier

    def check_in(self, num_blocks: int) -> None:
        """ResourceExhausted if the device tier has fewer than ``num_blocks`` free blocks."""
        device = self.device
        if num_blocks > device.num_free_blocks:
            raise ResourceExhausted(
                f"swap in needs {num_blocks} device blocks but only {device.num_free_blocks} of "
                f"{device.num_blocks} are free"
            )

    def move_out(self, seqs: list[Sequence]) -> tuple[int, int]:
        """Copy the device sequences ``seqs`` to the swap tier and release their device blocks
        (reverse table order: committed ones stay cached). Returns ``(blocks, bytes)`` copied.
        The caller checked the room (``check_out``)."""
        device_ids = [i for seq in seqs for i in seq.live_blocks]  # released entries stay behind
        tier = self.check_out(len(device_ids))
        slots = tier.allocate(len(device_ids))
        num_bytes = copy_blocks(self.device, device_ids, tier, slots)
        pos = 0
        for seq in seqs:
            n = seq.num_blocks
            seq.tier_slots = slots[pos : pos + n]
            pos += n
            self.device.release(seq.live_blocks[::-1])
            seq.block_table = []
            seq.room = 0
            seq.cached_blocks = None
            seq.location = tier.name
        self.stats.num_swap_out_blocks += len(device_ids)
        self.stats.num_swap_out_bytes += num_bytes
        return len(device_ids), num_bytes

    def move_in(self, seqs: list[Sequence]) -> tuple[int, int]:
        """Copy the swapped-out sequences ``seqs`` to fresh device blocks (their new block
        tables) and release the slots they held. Returns ``(blocks, bytes)`` copied. The caller
        checked the room (``check_in``) and sets what depends on the new tables."""
        total = sum(len(seq.tier_slots) for seq in seqs)
        new_ids = self.device.allocate(total)
        moves: dict[str, tuple[list[int], list[int]]] = {}  # tier name -> (its slots, device ids)
        tables = []
        pos = 0
        for seq in seqs:
            n = len(seq.tier_slots)
            tables.append(new_ids[pos : pos + n])
            slots, device_ids = moves.setdefault(seq.location, ([], []))
            slots += seq.tier_slots
            device_ids += tables[-1]
            pos += n
        num_bytes = 0
        for name, (slots, device_ids) in moves.items():
            tier = self.tiers[name]
            num_bytes += copy_blocks(tier, slots, self.device, device_ids)
            tier.release(slots)
        for seq, table in zip(seqs, tables, strict=True):
            seq.block_table = [PLACEHOLDER_BLOCK] * seq.num_released_blocks + table  # positions kept
            seq.tier_slots = []
            seq.location = self.device.name
        self.stats.num_swap_in_blocks += total
        self.stats.num_swap_in_bytes += num_bytes
        return total, num_bytes
