"""The sequence table's collaborators alone: the host area swap copies through, Swapping over it,
the evictions the block manager returns for the tiers below, Fencing and TenantLimits, each built
from its explicit inputs."""

from __future__ import annotations

import pytest
import torch

from kvtier.block_hash import extra_key, hash_full_blocks, hash_preimage, pack_token_ids
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import ExceedsLimit, InvalidArgument, ResourceExhausted
from kvtier.cachesvc.fencing import Fencing
from kvtier.cachesvc.host_area import HostArea
from kvtier.cachesvc.limits import TenantLimits
from kvtier.cachesvc.records import DEVICE, CacheStats, Sequence
from kvtier.cachesvc.swap import Swapping
from kvtier.cachesvc.tiers import DeviceTier

BS = 4


def pool_and_tiers(num_blocks: int = 8, host_blocks: int = 4):
    """A block-major pool whose block b is filled with b + 1, its device tier and a host area of
    ``host_blocks`` slots beside it (swap's own: no host cache)."""
    pool = torch.zeros(num_blocks, 2, 2, BS, 1, 3)
    for b in range(num_blocks):
        pool[b].fill_(b + 1)
    host = HostArea.for_pool(pool.view(num_blocks, -1).view(torch.uint8), host_blocks * pool[0].nbytes)
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


def test_the_host_area_reports_swap_s_share_and_refuses_more_than_is_free_taking_nothing():
    _, device, host = pool_and_tiers(num_blocks=8, host_blocks=4)
    assert (host.name, host.num_blocks, host.num_free_blocks, host.num_used_blocks) == ("host", 4, 4, 0)
    slots, given_up = host.reserve(3)
    assert (slots, given_up, host.num_used_blocks) == ([0, 1, 2], None, 3)
    with pytest.raises(ResourceExhausted, match="swap needs 2 slots but only 1 of 4 are not swap's"):
        host.reserve(2)
    assert host.num_free_blocks == 1 and host.used_slots() == [0, 1, 2]
    host.release(slots)
    assert host.num_free_blocks == 4
    host.check_invariants()
    assert device.allocate(8) and device.num_free_blocks == 0
    with pytest.raises(ResourceExhausted):
        device.allocate(1)


def test_the_host_area_copies_pool_blocks_in_and_out_byte_exact_through_one_path():
    pool, device, host = pool_and_tiers()
    slots, _ = host.reserve(2)
    host.store([5, 2], slots)
    pool[[5, 2]] = 0
    back = device.allocate(2)
    host.load(slots, back)
    assert [float(pool[b].flatten()[0]) for b in back] == [6.0, 3.0]
    with pytest.raises(InvalidArgument, match="is not a swap slot"):
        host.load([3], [0])
    with pytest.raises(InvalidArgument, match="len"):
        host.load(slots, [1])
    with pytest.raises(InvalidArgument, match="name a slot twice"):
        host.release([slots[0], slots[0]])


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
    with pytest.raises(ResourceExhausted, match="no host area"):
        Swapping(device, None, CacheStats()).check_out(1)
    device.allocate(7)
    with pytest.raises(ResourceExhausted, match="swap in needs 2 device blocks but only 1 of 8"):
        Swapping(device, host, CacheStats()).check_in(2)


def test_the_block_manager_returns_published_blocks_it_evicts_while_tiers_are_below():
    bm = BlockManager(2, BS)
    device = DeviceTier(bm)
    tokens, extra = list(range(BS)), extra_key("fp")
    (block,) = device.allocate(1)
    bm.publish_blocks([block], [], 0, 1, tokens, extra, pack_token_ids(tokens))
    device.release([block])
    bm.keep_evicted = True  # a table with tiers below sets it
    device.allocate(1)  # the empty block first: nothing evicted
    assert bm.take_evicted() == ([], [])
    device.allocate(1)  # now the published one: its KV is still in the pool until written
    ids, keys = bm.take_evicted()
    assert (ids, keys) == ([block], [extra + pack_token_ids(tokens)])
    assert [hash_preimage(k) for k in keys] == hash_full_blocks(pack_token_ids(tokens), BS, extra)
    assert bm.take_evicted() == ([], [])  # each eviction is returned once
    bm.keep_evicted = False
    device.release([0, 1])
    device.allocate(2)
    assert bm.evicted_ids == []  # nothing collected without tiers below


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
