"""The sequence table's collaborators alone: the tier interface, Swapping over it, the eviction hook
for a tiered prefix cache, Fencing and TenantLimits, each built from its explicit inputs."""

from __future__ import annotations

import pytest
import torch

from kvtier.block_hash import extra_key, hash_full_blocks, hash_preimage, pack_token_ids
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import ExceedsLimit, InvalidArgument, ResourceExhausted
from kvtier.cachesvc.fencing import Fencing
from kvtier.cachesvc.host_tier import HostTier
from kvtier.cachesvc.limits import TenantLimits
from kvtier.cachesvc.records import DEVICE, CacheStats, Sequence
from kvtier.cachesvc.swap import Swapping
from kvtier.cachesvc.tiers import DeviceTier, copy_blocks

BS = 4


def pool_and_tiers(num_blocks: int = 8, host_blocks: int = 4):
    """A block-major pool whose block b is filled with b + 1, its device tier and a host tier."""
    pool = torch.zeros(num_blocks, 2, 2, BS, 1, 3)
    for b in range(num_blocks):
        pool[b].fill_(b + 1)
    host = HostTier(pool, host_blocks)
    return pool, DeviceTier(BlockManager(num_blocks, BS), host.block_bytes), host


def record(sid: int, table: list[int], tenant: str = "") -> Sequence:
    tokens = list(range(len(table) * BS))
    return Sequence(
        sequence_id=sid,
        lease_id="L",
        token_ids=tokens,
        block_table=table,
        num_computed_tokens=len(tokens),
        num_cached_tokens=0,
        location=DEVICE,
        tier_slots=[],
        extra=b"",
        prompt_bytes=b"",
        block_hashes=[],
        tenant=tenant,
        room=len(tokens),
    )


def test_a_tier_reports_capacity_and_refuses_more_than_is_free_taking_nothing():
    _, device, host = pool_and_tiers(num_blocks=8, host_blocks=4)
    assert (host.name, host.num_blocks, host.num_free_blocks, host.num_used_bytes) == ("host", 4, 4, 0)
    slots = host.allocate(3)
    assert host.num_used_blocks == 3 and host.num_used_bytes == 3 * host.block_bytes
    with pytest.raises(ResourceExhausted, match="need 2 blocks but only 1 of 4"):
        host.allocate(2)
    assert host.num_free_blocks == 1
    host.release(slots)
    assert host.num_free_blocks == 4
    assert device.allocate(8) and device.num_free_blocks == 0
    with pytest.raises(ResourceExhausted):
        device.allocate(1)


def test_copy_blocks_moves_bytes_both_ways_and_counts_them_in_both_tiers():
    pool, device, host = pool_and_tiers()
    slots = host.allocate(2)
    assert copy_blocks(device, [5, 2], host, slots) == 2 * host.block_bytes
    pool[[5, 2]] = 0
    back = device.allocate(2)
    copy_blocks(host, slots, device, back)
    assert [float(pool[b].flatten()[0]) for b in back] == [6.0, 3.0]
    assert (device.stats.blocks_out, device.stats.blocks_in) == (2, 2)
    assert (host.stats.blocks_in, host.stats.blocks_out) == (2, 2)
    assert host.stats.bytes_in == host.stats.bytes_out == 2 * host.block_bytes
    with pytest.raises(InvalidArgument, match="one side must be the device"):
        copy_blocks(host, slots, host, slots)
    with pytest.raises(InvalidArgument, match="len"):
        copy_blocks(device, [1], host, slots)


def test_swapping_moves_whole_sequences_out_and_back_and_names_the_tier_in_the_record():
    pool, device, host = pool_and_tiers()
    stats = CacheStats()
    swapping = Swapping(device, host, stats)
    a, b = record(1, device.allocate(2)), record(2, device.allocate(1))
    want = [float(pool[i].flatten()[0]) for i in a.block_table + b.block_table]
    assert swapping.move_out([a, b]) == (3, 3 * host.block_bytes)
    assert (a.location, a.block_table, len(a.tier_slots), a.room) == ("host", [], 2, 0)
    assert device.num_free_blocks == 8 and host.num_used_blocks == 3
    pool.zero_()
    swapping.check_in(3)
    assert swapping.move_in([a, b]) == (3, 3 * host.block_bytes)
    assert a.location == b.location == DEVICE and a.tier_slots == b.tier_slots == []
    assert [float(pool[i].flatten()[0]) for i in a.block_table + b.block_table] == want
    assert host.num_used_blocks == 0
    assert (stats.num_swap_out_blocks, stats.num_swap_in_blocks) == (3, 3)


def test_swapping_refuses_without_room_and_without_a_swap_tier():
    _, device, host = pool_and_tiers(host_blocks=1)
    with pytest.raises(ResourceExhausted, match="swap out needs 2 host blocks but only 1 of 1"):
        Swapping(device, host, CacheStats()).check_out(2)
    with pytest.raises(ResourceExhausted, match="no host tier"):
        Swapping(device, None, CacheStats()).check_out(1)
    device.allocate(7)
    with pytest.raises(ResourceExhausted, match="swap in needs 2 device blocks but only 1 of 8"):
        Swapping(device, host, CacheStats()).check_in(2)


def test_the_evict_hook_hears_of_published_blocks_before_their_slots_are_reused():
    bm = BlockManager(2, BS)
    device = DeviceTier(bm)
    heard = []
    device.on_evict(lambda ids, keys: heard.append((list(ids), [hash_preimage(k) for k in keys], list(keys))))
    tokens, extra = list(range(BS)), extra_key("fp")
    (block,) = device.allocate(1)
    bm.publish_blocks([block], [], 0, 1, tokens, extra, pack_token_ids(tokens))
    device.release([block])
    device.allocate(1)  # the empty block first: nothing evicted
    assert heard == []
    device.allocate(1)  # now the published one
    assert heard == [
        ([block], hash_full_blocks(pack_token_ids(tokens), BS, extra), [extra + pack_token_ids(tokens)])
    ]
    device.on_evict(None)


def test_fencing_holds_blocks_until_their_time_or_their_lease_gives_up():
    bm = BlockManager(8, BS)
    fencing = Fencing(bm)
    fencing.hold(10.0, bm.allocate(2), "a")
    fencing.hold(20.0, bm.allocate(3), "b")
    fencing.hold(30.0, [], "c")  # nothing to hold: no entry
    assert fencing.num_fenced_blocks == 5 and len(fencing.block_lists()) == 2
    assert fencing.release_fenced(now=9.9) == 0
    assert fencing.release_fenced(now=10.0) == 2 and bm.num_free_blocks == 5
    assert fencing.release_fenced_of("b") == 3 and fencing.num_fenced_blocks == 0
    assert bm.num_free_blocks == 8


def test_tenant_limits_alone_over_the_records_they_are_given():
    bm = BlockManager(16, BS)
    records: dict[int, Sequence] = {}
    limits = TenantLimits(bm, records, tenant_quotas={"a": 4}, max_blocks_per_lease=6)
    with pytest.raises(ExceedsLimit, match="tenant 'a' may hold"):
        limits.check_fits("items[0]", "a", 5)
    records[1] = record(1, bm.allocate(3), tenant="a")
    limits.added("a", "L", 3)
    assert limits.tenant_blocks == {"a": 3} and limits.tenant_sequences == {"a": 1}
    with pytest.raises(ResourceExhausted, match="tenant 'a' holds 3 of its 4-block quota"):
        limits.check("L", {"a": 2}, 2)
    limits.check("L", {"b": 3}, 3)  # b has no quota; the lease holds 3 + 3 = 6
    with pytest.raises(ResourceExhausted, match="lease L… holds 3 of the 6 blocks"):
        limits.check("L", {"b": 4}, 4)
    limits.released("a", "L", 3)
    assert limits.tenant_blocks == {} and limits.tenant_sequences == {} and limits.lease_blocks == {}
