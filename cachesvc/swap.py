"""Swapping: whole sequences moved between the device pool and swap's share of the host area.

``SequenceTable.swap_out`` / ``swap_in`` validate a call, check the limits and apply its commits;
``Swapping`` then checks the room and moves the blocks: it reserves slots of the host area
(``cachesvc.host_area``: the host cache gives up cached blocks for them, which go down the tiers
below it through ``TierStack.reserve``), copies the blocks with the area's one copy path,
releases what they left, and updates each moved record's location, tables and the swap counters.
It reads and writes only the records it is handed, the area, the tiers and the counters it was
built with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.cachesvc.errors import ResourceExhausted
from kvtier.cachesvc.records import PLACEHOLDER_BLOCK
from kvtier.cachesvc.tiers import DeviceTier

if TYPE_CHECKING:
    from kvtier.cachesvc.host_area import HostArea
    from kvtier.cachesvc.lower_tiers import TierStack
    from kvtier.cachesvc.records import CacheStats, Sequence


class Swapping:
    """Moves sequences' blocks between ``device`` and ``area`` (the host area; None: no swap
    space); counts them in ``stats``. ``lower``: the tiers the host cache's given-up blocks go
    down (None: nothing below the device)."""

    def __init__(
        self, device: DeviceTier, area: HostArea | None, stats: CacheStats, lower: TierStack | None = None
    ) -> None:
        self.device = device
        self.area = area
        self.stats = stats
        self.lower = lower
        self.block_bytes = area.block_bytes if area is not None else 0

    def check_out(self, num_blocks: int) -> HostArea:
        """The area ``num_blocks`` device blocks would go to; ResourceExhausted if it has no room."""
        tier = self.area
        if tier is None:
            raise ResourceExhausted(
                "no host area is configured (host cache and swap space 0): cannot swap out"
            )
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
        if self.lower is not None:
            slots = self.lower.reserve(tier, len(device_ids))
        else:
            slots, _ = tier.reserve(len(device_ids))
        tier.store(device_ids, slots)
        num_bytes = len(device_ids) * self.block_bytes
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
        if self.lower is not None:  # blocks evicted for new_ids go down before they are written
            self.lower.keep_evicted(self.device.block_manager)
        tables = []
        pos = 0
        for seq in seqs:
            tables.append(new_ids[pos : pos + len(seq.tier_slots)])
            pos += len(seq.tier_slots)
        slots = [s for seq in seqs for s in seq.tier_slots]
        self.area.load(slots, new_ids)
        self.area.release(slots)
        num_bytes = total * self.block_bytes
        for seq, table in zip(seqs, tables, strict=True):
            seq.block_table = [PLACEHOLDER_BLOCK] * seq.num_released_blocks + table  # positions kept
            seq.tier_slots = []
            seq.location = self.device.name
        self.stats.num_swap_in_blocks += total
        self.stats.num_swap_in_bytes += num_bytes
        return total, num_bytes
