"""Consistency checks of the sequence table over its block manager and host tier.

For tests and debugging (``SequenceTable.check_invariants``): every check reads, none writes, and
a broken invariant raises AssertionError naming the sequence and the figures that disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachesvc.records import DEVICE, HOST
from kvtier.block_hash import pack_token_ids

if TYPE_CHECKING:
    from cachesvc.sequences import SequenceTable


def check_table(table: SequenceTable) -> None:
    """Block-manager invariants over all device tables and fenced blocks, plus per-sequence,
    per-lease, per-tenant and host-tier accounting."""
    bs = table.block_size
    device_tables = []
    host_slots: list[int] = []
    for sid, seq in table._sequences.items():
        assert seq.sequence_id == sid, f"sequence {sid} is filed under id {seq.sequence_id}"
        assert table._by_lease.get(seq.lease_id, {}).get(sid) is seq, (
            f"sequence {sid} missing from its lease index"
        )
        assert seq.prompt_bytes == pack_token_ids(seq.token_ids[: len(seq.prompt_bytes) // 4]), (
            f"sequence {sid}: prompt_bytes do not match its leading token ids"
        )
        assert seq.num_cached_tokens <= seq.num_computed_tokens <= len(seq.token_ids), (
            f"sequence {sid}: cached {seq.num_cached_tokens} <= computed {seq.num_computed_tokens} "
            f"<= tokens {len(seq.token_ids)} does not hold"
        )
        if seq.location == DEVICE:
            assert not seq.host_slots, f"device sequence {sid} holds host slots {seq.host_slots}"
            assert len(seq.token_ids) <= len(seq.block_table) * bs, (
                f"sequence {sid}: {len(seq.token_ids)} tokens exceed {len(seq.block_table)} blocks"
            )
            assert seq.num_published_blocks <= min(len(seq.block_hashes), len(seq.block_table)), (
                f"sequence {sid}: {seq.num_published_blocks} published blocks but {len(seq.block_hashes)} hashes"
            )
            assert seq.room == table._room(seq.block_table), (
                f"sequence {sid}: room {seq.room} does not match {len(seq.block_table)} blocks"
            )
            device_tables.append(seq.block_table)
        else:
            assert seq.location == HOST, f"sequence {sid} has location {seq.location!r}"
            assert not seq.block_table, f"host sequence {sid} holds device blocks {seq.block_table}"
            assert len(seq.token_ids) <= len(seq.host_slots) * bs, (
                f"sequence {sid}: {len(seq.token_ids)} tokens exceed {len(seq.host_slots)} host slots"
            )
            assert seq.room == 0, f"host sequence {sid} has room {seq.room}"
            host_slots += seq.host_slots
    n_lease_seqs = sum(len(v) for v in table._by_lease.values())
    assert n_lease_seqs == len(table._sequences), (
        f"lease index holds {n_lease_seqs} sequences, table holds {len(table._sequences)}"
    )
    assert all(table._by_lease.values()), "lease index keeps an empty lease"
    by_tenant: dict[str, int] = {}
    by_lease: dict[str, int] = {}
    for seq in table._sequences.values():
        if seq.num_blocks:
            by_tenant[seq.tenant] = by_tenant.get(seq.tenant, 0) + seq.num_blocks
            by_lease[seq.lease_id] = by_lease.get(seq.lease_id, 0) + seq.num_blocks
    assert by_tenant == table.tenant_blocks, f"tenant block counts {table.tenant_blocks} != held {by_tenant}"
    assert by_lease == table.lease_blocks, f"lease block counts {table.lease_blocks} != held {by_lease}"
    seqs_by_tenant: dict[str, int] = {}
    for seq in table._sequences.values():
        seqs_by_tenant[seq.tenant] = seqs_by_tenant.get(seq.tenant, 0) + 1
    assert seqs_by_tenant == table.tenant_sequences, (
        f"tenant sequence counts {table.tenant_sequences} != live {seqs_by_tenant}"
    )
    table.block_manager.check_invariants(device_tables + [ids for _, ids, _ in table.fenced])
    host = table.host_tier
    if host is None:
        assert not host_slots, "sequences hold host slots but there is no host tier"
        return
    assert sorted(host_slots) == host.used_slots(), (
        f"host slots held by sequences {sorted(host_slots)} != slots in use {host.used_slots()}"
    )
    assert host.num_used_blocks == len(host_slots), (
        f"host tier counts {host.num_used_blocks} used slots, sequences hold {len(host_slots)}"
    )
