"""Consistency checks of the sequence table over its block manager, limits, fencing and tiers.

For tests and debugging (``SequenceTable.check_invariants``): every check reads, none writes, and
a broken invariant raises AssertionError naming the sequence and the figures that disagree. It
reads the table through its public readers (``sequences()``, ``lease_index()``, ``limits``,
``fencing``, ``tiers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvtier.block_hash import pack_token_ids
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.fencing import Fencing
from kvtier.cachesvc.limits import TenantLimits
from kvtier.cachesvc.records import DEVICE, PLACEHOLDER_BLOCK, Sequence

if TYPE_CHECKING:
    from kvtier.cachesvc.host_area import HostArea


class TableView(Protocol):
    """What the checks read of a ``cachesvc.sequences.SequenceTable``."""

    block_size: int
    block_manager: BlockManager
    limits: TenantLimits
    fencing: Fencing
    tiers: dict[str, object]  # location -> the DeviceTier or the HostArea

    def get(self, sequence_id: int) -> Sequence: ...
    def sequences(self) -> list[Sequence]: ...
    def lease_index(self) -> dict[str, dict[int, Sequence]]: ...
    def room(self, block_table: list[int]) -> int: ...


def check_table(table: TableView) -> None:
    """Block-manager invariants over all device tables and fenced blocks, plus per-sequence,
    per-lease, per-tenant and host-tier accounting."""
    bs = table.block_size
    by_lease_index = table.lease_index()
    live = table.sequences()
    device_tables = []
    tier_slots: dict[str, list[int]] = {name: [] for name in table.tiers if name != DEVICE}
    for seq in live:
        sid = seq.sequence_id
        assert table.get(sid) is seq, f"sequence {sid} is not filed under its id"
        assert by_lease_index.get(seq.lease_id, {}).get(sid) is seq, (
            f"sequence {sid} missing from its lease index"
        )
        assert seq.prompt_bytes == pack_token_ids(seq.token_ids[: len(seq.prompt_bytes) // 4]), (
            f"sequence {sid}: prompt_bytes do not match its leading token ids"
        )
        assert seq.num_cached_tokens <= seq.num_computed_tokens <= len(seq.token_ids), (
            f"sequence {sid}: cached {seq.num_cached_tokens} <= computed {seq.num_computed_tokens} "
            f"<= tokens {len(seq.token_ids)} does not hold"
        )
        assert seq.num_released_blocks * bs <= seq.num_computed_tokens, (
            f"sequence {sid}: {seq.num_released_blocks} released blocks reach past its "
            f"{seq.num_computed_tokens} computed tokens"
        )
        if seq.location == DEVICE:
            assert not seq.tier_slots, f"device sequence {sid} holds tier slots {seq.tier_slots}"
            assert len(seq.token_ids) <= len(seq.block_table) * bs, (
                f"sequence {sid}: {len(seq.token_ids)} tokens exceed {len(seq.block_table)} blocks"
            )
            assert seq.num_published_blocks <= min(len(seq.block_hashes), len(seq.block_table)), (
                f"sequence {sid}: {seq.num_published_blocks} published blocks but {len(seq.block_hashes)} hashes"
            )
            assert seq.room == table.room(seq.block_table), (
                f"sequence {sid}: room {seq.room} does not match {len(seq.block_table)} blocks"
            )
            released = seq.block_table[: seq.num_released_blocks]
            assert released == [PLACEHOLDER_BLOCK] * seq.num_released_blocks, (
                f"sequence {sid}: released entries {released} are not placeholders"
            )
            assert seq.num_released_blocks <= seq.num_published_blocks, (
                f"sequence {sid}: {seq.num_released_blocks} released blocks but {seq.num_published_blocks} published"
            )
            device_tables.append(seq.live_blocks)
        else:
            assert seq.location in tier_slots, f"sequence {sid} has location {seq.location!r}"
            assert not seq.block_table, f"{seq.location} sequence {sid} holds device blocks {seq.block_table}"
            positions = seq.num_released_blocks + len(seq.tier_slots)  # released ones hold no slot
            assert len(seq.token_ids) <= positions * bs, (
                f"sequence {sid}: {len(seq.token_ids)} tokens exceed {seq.num_released_blocks} released "
                f"blocks + {len(seq.tier_slots)} {seq.location} slots"
            )
            assert seq.room == 0, f"{seq.location} sequence {sid} has room {seq.room}"
            tier_slots[seq.location] += seq.tier_slots
    n_lease_seqs = sum(len(v) for v in by_lease_index.values())
    assert n_lease_seqs == len(live), f"lease index holds {n_lease_seqs} sequences, table holds {len(live)}"
    assert all(by_lease_index.values()), "lease index keeps an empty lease"
    _check_counts(table, live)
    table.block_manager.check_invariants(device_tables + table.fencing.block_lists())
    for name, slots in tier_slots.items():
        _check_tier(table.tiers[name], slots)


def _check_counts(table: TableView, live: list[Sequence]) -> None:
    """The limits' per-tenant and per-lease counts against the blocks the records hold."""
    limits = table.limits
    by_tenant: dict[str, int] = {}
    by_lease: dict[str, int] = {}
    for seq in live:
        if seq.num_blocks:
            by_tenant[seq.tenant] = by_tenant.get(seq.tenant, 0) + seq.num_blocks
            by_lease[seq.lease_id] = by_lease.get(seq.lease_id, 0) + seq.num_blocks
    assert by_tenant == limits.tenant_blocks, (
        f"tenant block counts {limits.tenant_blocks} != held {by_tenant}"
    )
    assert by_lease == limits.lease_blocks, f"lease block counts {limits.lease_blocks} != held {by_lease}"
    seqs_by_tenant: dict[str, int] = {}
    for seq in live:
        seqs_by_tenant[seq.tenant] = seqs_by_tenant.get(seq.tenant, 0) + 1
    assert seqs_by_tenant == limits.tenant_sequences, (
        f"tenant sequence counts {limits.tenant_sequences} != live {seqs_by_tenant}"
    )


def _check_tier(tier: HostArea, held: list[int]) -> None:
    """A lower tier's used slots are exactly those its sequences hold."""
    assert tier.num_used_blocks == len(held), (
        f"{tier.name} tier counts {tier.num_used_blocks} used slots, sequences hold {len(held)}"
    )
    used_slots = getattr(tier, "used_slots", None)  # O(capacity): a tier may not list them
    if used_slots is not None:
        assert sorted(held) == used_slots(), (
            f"{tier.name} slots held by sequences {sorted(held)} != slots in use {used_slots()}"
        )
