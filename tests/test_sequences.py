"""SequenceTable: prefix hits, publish on commit, batching all or nothing, leases, swapping."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import (
    CacheError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvtier.cachesvc.host_area import HostArea
from kvtier.cachesvc.sequences import SequenceTable
from kvtier.sequence_types import AllocateItem

BS = 4
VOCAB = 100
LEASE = "lease-a"
OTHER = "lease-b"


def make_table(
    num_blocks: int = 16, host_blocks: int | None = 8, max_model_len: int = 64, max_batch: int = 8
) -> SequenceTable:
    bm = BlockManager(num_blocks, BS)
    host = None
    if host_blocks is not None:
        # Block-major pool [num_blocks, num_layers=2, K/V=2, block_size, num_kv_heads=1, head_dim=3].
        pool = torch.zeros(num_blocks, 2, 2, BS, 1, 3)
        host = HostArea.for_pool(pool.view(num_blocks, -1).view(torch.uint8), host_blocks * pool[0].nbytes)
        host.pool = pool  # the block-shaped view of its rows the tests write
    return SequenceTable(
        bm, host, model_fingerprint="fp", vocab_size=VOCAB, max_model_len=max_model_len, max_batch=max_batch
    )


def alloc(table: SequenceTable, tokens: list[int], lease: str = LEASE, **kw) -> int:
    (view,) = table.allocate(lease, [AllocateItem(tokens, **kw)])
    return view.sequence_id


def alloc_commit_free(table: SequenceTable, tokens: list[int], **kw) -> None:
    """One finished request: its prompt becomes cached (full blocks) and its blocks free."""
    sid = alloc(table, tokens, **kw)
    table.commit(LEASE, [(sid, [], len(tokens))])
    table.free(LEASE, [sid])


def snapshot(table: SequenceTable) -> tuple:
    """Everything a failed call must leave alone, LRU order and counters included."""
    bm = table.block_manager
    host = table.host_area
    return (
        bm.free_block_ids(),
        [(b.ref_cnt, b.block_hash) for b in bm.blocks],
        {h: b.block_id for h, b in bm.prefix_index.items()},
        bm.num_evictions,
        [dataclasses.astuple(s) for s in table.sequences()],
        dataclasses.astuple(table.stats),
        host.used_slots() if host else None,
        host.slots.view(torch.uint8).clone() if host else None,  # bitwise: slots start uninitialized
        table._next_sequence_id,
    )


def assert_same(before: tuple, after: tuple) -> None:
    *plain_b, slots_b, next_b = before
    *plain_a, slots_a, next_a = after
    assert plain_a == plain_b
    assert next_a == next_b
    if slots_b is not None:
        assert torch.equal(slots_a, slots_b)


# ---------------------------------------------------------------------- prefix hits


def test_full_block_prefix_is_a_hit() -> None:
    table = make_table()
    prompt = list(range(10))  # blocks [0..3] [4..7] + partial [8, 9]
    alloc_commit_free(table, prompt)
    (view,) = table.allocate(LEASE, [AllocateItem(prompt[:8] + [50, 51, 52])])
    assert view.num_cached_tokens == 8
    assert view.num_slots == 12
    seq = table.get(view.sequence_id)
    assert seq.num_computed_tokens == 8
    assert table.stats.prefix_query_tokens == 10 + 11
    assert table.stats.prefix_hit_tokens == 8
    table.check_invariants()


def test_partial_block_is_never_cached() -> None:
    table = make_table()
    alloc_commit_free(table, list(range(7)))  # one full block + 3 tokens
    assert table.block_manager.num_cached_blocks == 1
    assert table.lookup_prefix([(list(range(7)), "", "")]) == [4]
    (view,) = table.allocate(LEASE, [AllocateItem(list(range(7)) + [90])])
    assert view.num_cached_tokens == 4


def test_hit_is_capped_below_last_prompt_token() -> None:
    table = make_table()
    prompt = list(range(8))  # exactly two full blocks
    alloc_commit_free(table, prompt)
    assert table.lookup_prefix([(prompt, "", "")]) == [8]  # LookupPrefix is not capped
    (view,) = table.allocate(LEASE, [AllocateItem(prompt)])
    # Only the first block is reused: the last prompt token must be computed for its logits.
    assert view.num_cached_tokens == 4
    assert len(view.block_table) == 2
    (one,) = table.allocate(LEASE, [AllocateItem(prompt[:4])])
    assert one.num_cached_tokens == 0
    table.check_invariants()


def test_shared_prefix_ref_counts() -> None:
    table = make_table()
    prefix = list(range(8))
    alloc_commit_free(table, prefix + [9])
    views = table.allocate(LEASE, [AllocateItem(prefix + [20, 21]), AllocateItem(prefix + [30])])
    bm = table.block_manager
    shared = views[0].block_table[:2]
    assert views[1].block_table[:2] == shared
    assert [bm.ref_count(b) for b in shared] == [2, 2]
    assert bm.ref_count(views[0].block_table[2]) == 1
    table.free(LEASE, [views[0].sequence_id])
    assert [bm.ref_count(b) for b in shared] == [1, 1]
    table.check_invariants()


def test_hits_of_all_items_are_taken_before_new_blocks_are_allocated() -> None:
    table = make_table(num_blocks=4)
    alloc_commit_free(table, [0, 1, 2, 3, 9])  # block 0 cached, block 1 partial; queue [2, 3, 1, 0]
    table.free(LEASE, [alloc(table, [7] * 8)])  # queue [1, 0, 3, 2]: the cached block is 2nd
    # Item 0 alone would pop blocks 1 and 0, evicting item 1's hit. Hits are taken first.
    views = table.allocate(LEASE, [AllocateItem([50] * 8), AllocateItem([0, 1, 2, 3, 60])])
    assert views[1].num_cached_tokens == 4
    assert views[1].block_table[0] == 0
    assert 0 not in views[0].block_table
    assert table.block_manager.num_evictions == 0
    table.check_invariants()


def test_uncommitted_block_is_never_a_hit() -> None:
    table = make_table()
    prompt = list(range(12))
    sid = alloc(table, prompt)
    (view,) = table.allocate(LEASE, [AllocateItem(prompt)])
    assert view.num_cached_tokens == 0
    assert table.lookup_prefix([(prompt, "", "")]) == [0]
    # Partly computed: only blocks entirely inside num_computed_tokens are published.
    assert table.commit(LEASE, [(sid, [], 6)]) == 1
    assert table.lookup_prefix([(prompt, "", "")]) == [4]
    assert table.commit(LEASE, [(sid, [], 12)]) == 2
    assert table.lookup_prefix([(prompt, "", "")]) == [12]
    table.check_invariants()


def test_generated_tokens_are_published_when_committed() -> None:
    table = make_table()
    sid = alloc(table, [1, 2, 3], num_lookahead_tokens=5)
    assert table.get(sid).block_table.__len__() == 2
    table.commit(LEASE, [(sid, [], 3)])
    assert table.commit(LEASE, [(sid, [4, 5, 6], 5)]) == 1
    assert table.get(sid).token_ids == [1, 2, 3, 4, 5, 6]
    assert table.lookup_prefix([([1, 2, 3, 4, 5, 6], "", "")]) == [4]
    table.commit(LEASE, [(sid, [7, 8], 8)])
    assert table.lookup_prefix([([1, 2, 3, 4, 5, 6, 7, 8], "", "")]) == [8]
    table.check_invariants()


def test_cache_salt_isolates_tenants() -> None:
    table = make_table()
    prompt = list(range(9))
    alloc_commit_free(table, prompt, tenant_salt="tenant-a")
    assert table.lookup_prefix([(prompt, "tenant-a", ""), (prompt, "tenant-b", ""), (prompt, "", "")]) == [
        8,
        0,
        0,
    ]
    assert table.lookup_prefix([(prompt, "tenant-a", "lora")]) == [0]
    (other,) = table.allocate(LEASE, [AllocateItem(prompt, tenant_salt="tenant-b")])
    (same,) = table.allocate(LEASE, [AllocateItem(prompt, tenant_salt="tenant-a")])
    assert (other.num_cached_tokens, same.num_cached_tokens) == (0, 8)


def test_lookup_prefix_is_read_only() -> None:
    table = make_table()
    alloc_commit_free(table, list(range(9)))
    before = snapshot(table)
    assert table.lookup_prefix([(list(range(9)), "", ""), ([], "", "")]) == [8, 0]
    assert_same(before, snapshot(table))


def test_extend_adds_blocks_only_at_boundaries() -> None:
    table = make_table()
    sid = alloc(table, [1, 2, 3])
    (v,) = table.extend(LEASE, [(sid, 1)])
    assert len(v.block_table) == 1 and v.num_slots == 4
    (v,) = table.extend(LEASE, [(sid, 2)])
    assert len(v.block_table) == 2 and v.num_slots == 8
    (v2,) = table.extend(LEASE, [(sid, 0)])
    assert v2.block_table == v.block_table  # never shrinks
    table.check_invariants()


def test_one_sequence_crossing_a_boundary_grows_as_a_batch_does_and_refuses_the_same() -> None:
    """A single-item Extend that needs blocks takes its own short path (allocation.grow_one);
    a batch of two takes _extend. Both leave the same tables, LRU order, evictions and events,
    and a single item the short path cannot serve is refused as the batch path refuses it."""
    tables = [make_table(num_blocks=8), make_table(num_blocks=8)]
    for table in tables:  # a cached chain to evict, then two live sequences
        alloc_commit_free(table, list(range(16)))
        table.block_manager.take_event_records()
    sids = [[alloc(t, [5, 6, 7]), alloc(t, [8, 9])] for t in tables]
    one, batch = tables
    for num_tokens in (1, 2, 6):  # within the block, then one block more, then two
        got = [one.extend(LEASE, [(sid, num_tokens)])[0] for sid in sids[0]]
        assert batch.extend(LEASE, [(sid, num_tokens) for sid in sids[1]]) == got
    assert [len(v.block_table) for v in got] == [3, 2] and got[0].num_slots == 12
    assert snapshot(one)[:6] == snapshot(batch)[:6]
    assert one.block_manager.take_event_records() == batch.block_manager.take_event_records()
    one.check_invariants()

    before = snapshot(one)
    free = one.block_manager.num_free_blocks  # 3 of 8: the sequences hold 3 and 2 blocks
    refused = [
        (ResourceExhausted, (sids[0][0], 4 * (3 + free + 1) - 3)),  # its 3 tokens grow past its blocks + free
        (InvalidArgument, (sids[0][0], 64)),  # past max_model_len
        (InvalidArgument, (sids[0][1], -1)),
        (NotFound, (12345, 1)),
    ]
    for error, item in refused:
        with pytest.raises(error):
            one.extend(LEASE, [item])
        assert_same(before, snapshot(one))
    with pytest.raises(PermissionDenied):
        one.extend(OTHER, [(sids[0][0], 8)])
    assert_same(before, snapshot(one))
    one.swap_out(LEASE, [sids[0][1]])
    with pytest.raises(FailedPrecondition):
        one.extend(LEASE, [(sids[0][1], 8)])


def test_extend_within_slots_still_checks_max_model_len() -> None:
    table = make_table(max_model_len=10)
    sid = alloc(table, [1] * 9)  # 3 blocks = 12 slots, but only 10 tokens allowed
    (v,) = table.extend(LEASE, [(sid, 1)])
    assert v.num_slots == 12
    with pytest.raises(InvalidArgument, match=r"9 tokens \+ num_tokens 2 = 11 exceeds max_model_len 10"):
        table.extend(LEASE, [(sid, 2)])


def test_views_are_snapshots_of_the_block_table() -> None:
    table = make_table()
    sid = alloc(table, [1, 2, 3, 4])
    (before,) = table.extend(LEASE, [(sid, 0)])
    (after,) = table.extend(LEASE, [(sid, 1)])
    assert len(before.block_table) == 1 and before.num_slots == 4
    assert len(after.block_table) == 2 and after.num_slots == 8
    assert after.block_table[0] == before.block_table[0]
    assert table.get(sid).block_table is not after.block_table


def test_free_releases_blocks_tail_first() -> None:
    table = make_table(num_blocks=4)
    sid = alloc(table, list(range(13)))
    table.commit(LEASE, [(sid, [], 13)])
    table_ids = table.get(sid).block_table
    assert table.free(LEASE, [sid]) == 4
    assert table.block_manager.free_block_ids() == table_ids[::-1]
    with pytest.raises(NotFound):
        table.get(sid)


def test_sequence_ids_increase_from_one() -> None:
    table = make_table()
    views = table.allocate(LEASE, [AllocateItem([1]), AllocateItem([2])])
    assert [v.sequence_id for v in views] == [1, 2]
    table.free(LEASE, [1])
    assert alloc(table, [3]) == 3


def test_commit_rejects_tokens_beyond_slots_and_decreasing_computed() -> None:
    table = make_table()
    sid = alloc(table, [1, 2, 3])
    with pytest.raises(InvalidArgument, match=r"3 tokens \+ 2 new = 5 exceed the sequence's 4 slots"):
        table.commit(LEASE, [(sid, [4, 5], 3)])
    table.commit(LEASE, [(sid, [4], 3)])
    with pytest.raises(InvalidArgument, match=r"num_computed_tokens = 2 is not in \[3"):
        table.commit(LEASE, [(sid, [], 2)])
    with pytest.raises(InvalidArgument, match=r"num_computed_tokens = 5 is not in \[3 .*, 4"):
        table.commit(LEASE, [(sid, [], 5)])


def test_error_messages_name_value_and_limit() -> None:
    table = make_table(max_model_len=16)
    with pytest.raises(InvalidArgument, match=r"items\[1\]\.token_ids\[2\] = 100 is out of range \[0, 100\)"):
        table.allocate(LEASE, [AllocateItem([1]), AllocateItem([1, 2, 100])])
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.token_ids\[0\] = -1 is out of range"):
        table.allocate(LEASE, [AllocateItem([-1])])
    with pytest.raises(InvalidArgument, match=r"token_ids\[1\] = 4294967296 is not an int32"):
        table.allocate(LEASE, [AllocateItem([1, 2**32])])
    with pytest.raises(InvalidArgument, match=r"len\(token_ids\) = 17 is not in \[1, max_model_len 16\]"):
        table.allocate(LEASE, [AllocateItem([1] * 17)])
    with pytest.raises(InvalidArgument, match=r"len\(token_ids\) = 0"):
        table.allocate(LEASE, [AllocateItem([])])
    with pytest.raises(InvalidArgument, match=r"num_lookahead_tokens = -1 must be >= 0"):
        table.allocate(LEASE, [AllocateItem([1], num_lookahead_tokens=-1)])
    with pytest.raises(InvalidArgument, match=r"= 20 exceeds max_model_len 16"):
        table.allocate(LEASE, [AllocateItem([1] * 10, num_lookahead_tokens=10)])
    with pytest.raises(InvalidArgument, match=r"len\(items\) = 9 exceeds max_batch 8"):
        table.allocate(LEASE, [AllocateItem([1])] * 9)
    sid = alloc(table, [1])
    with pytest.raises(InvalidArgument, match=r"items\[1\]\.sequence_id = 1 appears more than once"):
        table.extend(LEASE, [(sid, 1), (sid, 2)])
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.num_tokens = -3 must be >= 0"):
        table.extend(LEASE, [(sid, -3)])
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.token_ids\[0\] = 100 is out of range"):
        table.commit(LEASE, [(sid, [100], 1)])


# ---------------------------------------------------------------------- leases and all-or-nothing


def test_lease_ownership_errors() -> None:
    table = make_table()
    sid = alloc(table, [1, 2, 3], lease=OTHER)
    calls = {
        "extend": lambda: table.extend(LEASE, [(sid, 1)]),
        "commit": lambda: table.commit(LEASE, [(sid, [], 3)]),
        "free": lambda: table.free(LEASE, [sid]),
        "swap_out": lambda: table.swap_out(LEASE, [sid]),
    }
    for name, call in calls.items():
        with pytest.raises(PermissionDenied, match=f"sequence_id = {sid} belongs to another lease"):
            call()
        assert table.get(sid).location == "device", name
    assert table.free(OTHER, [sid]) == 1
    with pytest.raises(NotFound, match=f"sequence_id = {sid} is not a live sequence"):
        table.free(OTHER, [sid])


def test_free_lease_releases_device_and_host_sequences() -> None:
    table = make_table()
    a = alloc(table, list(range(9)))
    b = alloc(table, [1, 2])
    c = alloc(table, [3], lease=OTHER)
    table.swap_out(LEASE, [b])
    assert table.host_area.num_used_blocks == 1
    assert table.free_lease(LEASE) == 3
    assert table.host_area.num_used_blocks == 0
    assert [s.sequence_id for s in table.sequences()] == [c]
    assert table.sequences_of(LEASE) == []
    assert table.free_lease("no-such-lease") == 0
    with pytest.raises(NotFound):
        table.get(a)
    table.check_invariants()


def test_an_expired_lease_s_blocks_with_uncommitted_slots_are_fenced_until_their_time() -> None:
    """Fencing: a writer frozen inside a KV write may finish it after its lease is released, so
    the blocks it could be writing (from the first one with an uncommitted slot) are held back;
    committed blocks go back to the prefix cache at once."""
    table = make_table(num_blocks=8, host_blocks=None)
    a = alloc(table, list(range(10)))  # 3 blocks
    table.commit(LEASE, [(a, [], 9)])  # blocks 0-1 committed, block 2 holds slot 9 unwritten
    alloc(table, [5, 6])  # 1 block, nothing committed
    other = alloc(table, [7], lease=OTHER)
    free_before = table.block_manager.num_free_blocks
    assert table.free_lease(LEASE, fence_until=100.0) == 2  # the two committed blocks
    assert table.fencing.num_fenced_blocks == 2
    assert table.block_manager.num_free_blocks == free_before + 2
    table.check_invariants()
    # Nothing can take a fenced block: allocating every free block leaves them out.
    fenced = {i for _, ids, _ in table.fencing.fenced for i in ids}
    taken = alloc(table, [9] * (BS * table.block_manager.num_free_blocks), lease=OTHER)
    assert not fenced & set(table.get(taken).block_table)
    table.free(OTHER, [taken, other])
    assert table.fencing.release_fenced(now=99.0) == 0 and table.fencing.num_fenced_blocks == 2
    assert table.fencing.release_fenced(now=100.0) == 2 and table.fencing.num_fenced_blocks == 0
    assert table.block_manager.num_free_blocks == 8
    table.check_invariants()


def test_batch_capacity_is_all_or_nothing() -> None:
    table = make_table(num_blocks=6)
    a = alloc(table, [1] * 8)  # 2 blocks; 4 free
    before = snapshot(table)
    with pytest.raises(ResourceExhausted, match="needs 5 new blocks for 2 sequences but only 4 of 6"):
        table.allocate(LEASE, [AllocateItem([2] * 8), AllocateItem([3] * 12)])
    assert_same(before, snapshot(table))
    b = alloc(table, [2] * 8)  # 2 free left
    before = snapshot(table)
    with pytest.raises(ResourceExhausted, match="extend needs 3 new blocks but only 2 of 6"):
        table.extend(LEASE, [(a, 4), (b, 8)])
    assert_same(before, snapshot(table))
    assert [len(v.block_table) for v in table.extend(LEASE, [(a, 4), (b, 4)])] == [3, 3]
    table.check_invariants()


def failing_calls(table: SequenceTable) -> dict[str, tuple[type[CacheError], object]]:
    """One failing call per error kind (and batch position), built over a populated table."""
    cached = list(range(9))
    alloc_commit_free(table, cached)
    live = alloc(table, [5, 6, 7], num_lookahead_tokens=5)
    table.commit(LEASE, [(live, [], 3)])
    swapped = alloc(table, [8, 9])
    table.swap_out(LEASE, [swapped])
    foreign = alloc(table, [1, 2], lease=OTHER)
    big = [AllocateItem([7] * 40)] * 2
    return {
        # Validation fails on a later item: earlier valid items (one a cache hit) must not apply.
        "allocate-bad-token": (
            InvalidArgument,
            lambda: table.allocate(LEASE, [AllocateItem(cached), AllocateItem([VOCAB])]),
        ),
        "allocate-no-room": (ResourceExhausted, lambda: table.allocate(LEASE, [AllocateItem(cached), *big])),
        "extend-unknown": (NotFound, lambda: table.extend(LEASE, [(live, 1), (999, 1)])),
        "extend-foreign": (PermissionDenied, lambda: table.extend(LEASE, [(live, 9), (foreign, 1)])),
        "extend-swapped": (FailedPrecondition, lambda: table.extend(LEASE, [(live, 9), (swapped, 1)])),
        "extend-no-room": (ResourceExhausted, lambda: table.extend(LEASE, [(live, 60)])),
        "commit-bad-token": (InvalidArgument, lambda: table.commit(LEASE, [(live, [1], 4), (live, [], 3)])),
        "commit-bad-computed": (
            InvalidArgument,
            lambda: table.commit(LEASE, [(live, [1, 2, 3, 4], 7), (live, [], 2)]),
        ),
        "free-duplicate": (InvalidArgument, lambda: table.free(LEASE, [live, live])),
        "free-foreign": (PermissionDenied, lambda: table.free(LEASE, [live, foreign])),
        "swap-out-swapped": (FailedPrecondition, lambda: table.swap_out(LEASE, [live, swapped])),
        "swap-out-host-full": (
            ResourceExhausted,
            lambda: table.swap_out(LEASE, [live, *[alloc(table, [1] * 30)]]),
        ),
        "swap-in-on-device": (FailedPrecondition, lambda: table.swap_in(LEASE, [swapped, live])),
        "lookup-bad-token": (
            InvalidArgument,
            lambda: table.lookup_prefix([(cached, "", ""), ([-5], "", "")]),
        ),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "allocate-bad-token",
        "allocate-no-room",
        "extend-unknown",
        "extend-foreign",
        "extend-swapped",
        "extend-no-room",
        "commit-bad-token",
        "commit-bad-computed",
        "free-duplicate",
        "free-foreign",
        "swap-out-swapped",
        "swap-out-host-full",
        "swap-in-on-device",
        "lookup-bad-token",
    ],
)
def test_failed_calls_change_no_state(kind: str) -> None:
    table = make_table(num_blocks=16, host_blocks=8)
    calls = failing_calls(table)
    error, call = calls[kind]
    if kind == "swap-out-host-full":
        # Build the oversized sequence first, so the snapshot includes it.
        big = alloc(table, [1] * 30)  # 8 blocks; the host tier has 7 free slots
        live = table.sequences_of(LEASE)[0].sequence_id
        call = lambda: table.swap_out(LEASE, [live, big])  # noqa: E731
    table.check_invariants()
    table.block_manager.take_events()
    before = snapshot(table)
    with pytest.raises(error):
        call()
    assert_same(before, snapshot(table))
    assert table.block_manager.take_events() == []
    table.check_invariants()


def test_commit_with_invalid_item_rejects_the_whole_batch() -> None:
    table = make_table()
    a = alloc(table, [1, 2, 3, 4, 5])
    b = alloc(table, [1, 2, 3, 4, 5])
    with pytest.raises(InvalidArgument, match=r"items\[1\]"):
        table.commit(LEASE, [(a, [], 5), (b, [], 9)])
    assert table.lookup_prefix([([1, 2, 3, 4, 5], "", "")]) == [0]
    assert table.get(a).num_computed_tokens == 0


# ---------------------------------------------------------------------- host tier


def fill_pattern(pool: torch.Tensor, block_ids: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in block_ids:
        pool[b] = torch.randn(pool[b].shape, generator=g)
        out.append(pool[b].clone())
    return out


def test_swap_round_trip_preserves_bytes() -> None:
    table = make_table(num_blocks=12, host_blocks=8)
    pool = table.host_area.pool
    a = alloc(table, list(range(10)))  # 3 blocks
    b = alloc(table, list(range(20, 26)))  # 2 blocks
    table.commit(LEASE, [(a, [], 10), (b, [], 6)])
    data_a = fill_pattern(pool, table.get(a).block_table, seed=1)
    data_b = fill_pattern(pool, table.get(b).block_table, seed=2)
    assert table.swap_out(LEASE, [a, b]) == (5, 5 * table.host_area.block_bytes)
    assert table.get(a).location == "host" and table.get(a).block_table == []
    table.check_invariants()
    # Reuse the freed device blocks so a stale table would read garbage.
    filler = alloc(table, [99] * 40)
    pool[table.get(filler).block_table] = -1.0
    table.free(LEASE, [filler])
    views, num_blocks, num_bytes = table.swap_in(LEASE, [b, a])
    assert (num_blocks, num_bytes) == (5, 5 * table.host_area.block_bytes)
    assert [v.sequence_id for v in views] == [b, a]
    assert [len(v.block_table) for v in views] == [2, 3]
    for view, data in ((views[0], data_b), (views[1], data_a)):
        for block_id, expected in zip(view.block_table, data, strict=True):
            assert torch.equal(pool[block_id], expected)
    assert table.host_area.num_used_blocks == 0
    stats = table.stats
    assert (stats.num_swap_out_blocks, stats.num_swap_in_blocks) == (5, 5)
    assert stats.num_swap_in_bytes == stats.num_swap_out_bytes == 5 * pool[0].numel() * 4
    # The sequence continues where it was: same tokens, computed count and prefix in the index.
    assert table.get(a).num_computed_tokens == 10
    assert table.lookup_prefix([(list(range(10)), "", "")]) == [8]
    table.check_invariants()


def test_swap_errors_are_failed_precondition_or_resource_exhausted() -> None:
    table = make_table(host_blocks=2)
    a = alloc(table, [1, 2, 3])
    with pytest.raises(FailedPrecondition, match=f"sequence_id = {a} is already on the device"):
        table.swap_in(LEASE, [a])
    table.swap_out(LEASE, [a])
    with pytest.raises(FailedPrecondition, match=f"sequence_id = {a} is swapped out to the host tier"):
        table.swap_out(LEASE, [a])
    with pytest.raises(FailedPrecondition, match="swapped out"):
        table.commit(LEASE, [(a, [], 1)])
    big = alloc(table, [1] * 9)
    with pytest.raises(ResourceExhausted, match="swap out needs 3 host blocks but only 1 of 2 are free"):
        table.swap_out(LEASE, [big])
    no_host = make_table(host_blocks=None)
    s = alloc(no_host, [1])
    with pytest.raises(ResourceExhausted, match="no host area is configured"):
        no_host.swap_out(LEASE, [s])


def test_swap_in_needs_device_room() -> None:
    table = make_table(num_blocks=4, host_blocks=4)
    a = alloc(table, [1] * 12)
    table.swap_out(LEASE, [a])
    hog = alloc(table, [2] * 8)
    before = snapshot(table)
    with pytest.raises(ResourceExhausted, match="swap in needs 3 device blocks but only 2 of 4 are free"):
        table.swap_in(LEASE, [a])
    assert_same(before, snapshot(table))
    table.free(LEASE, [hog])
    (view,), _, _ = table.swap_in(LEASE, [a])
    assert len(view.block_table) == 3
    table.check_invariants()


def test_the_host_area_for_a_pool_sizes_slots_by_block_bytes() -> None:
    pool = torch.zeros(4, 2, 2, BS, 1, 3, dtype=torch.float16)
    block_bytes = 2 * 2 * BS * 3 * 2
    area = HostArea.for_pool(pool.view(4, -1).view(torch.uint8), 5 * block_bytes + 1)
    assert (area.block_bytes, area.num_blocks, area.num_free_blocks) == (block_bytes, 5, 5)
    with pytest.raises(ResourceExhausted, match="swap needs 6 slots but only 5 of 5 are not swap's"):
        area.reserve(6)
    assert area.num_free_blocks == 5 and area.reserve(5)[0] == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------- commits carried by other calls


def test_extend_carrying_commits_applies_both_and_counts_room_after_the_commit() -> None:
    table = make_table(num_blocks=8)
    sid = alloc(table, [1, 2, 3, 4, 5, 6])  # 2 blocks (8 slots), 6 tokens
    # The replica wrote tokens 6..7 (two generated ids) and wants room for 4 more beyond them.
    (blocks,) = table.extend(LEASE, [(sid, 4)], commits=[(sid, [7, 8], 8)])
    seq = table.get(sid)
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and seq.num_computed_tokens == 8
    assert len(blocks.block_table) == 3  # 8 + 4 tokens: a third block, counted after the commit
    assert table.block_manager.num_cached_blocks == 2  # the commit published both full blocks
    table.check_invariants()


def test_a_refused_part_of_a_call_carrying_commits_applies_neither() -> None:
    table = make_table(num_blocks=4, host_blocks=None)
    sid = alloc(table, [1, 2, 3, 4, 5, 6])  # 2 of 4 blocks
    before = snapshot(table)
    # Room: 8 committed tokens + 12 more = 5 blocks, but only 2 are free: nothing changes.
    with pytest.raises(ResourceExhausted, match="extend needs 3 new blocks"):
        table.extend(LEASE, [(sid, 12)], commits=[(sid, [7, 8], 8)])
    assert snapshot(table) == before
    # A bad commit (computed tokens beyond the token count) refuses the extend too.
    with pytest.raises(InvalidArgument, match="num_computed_tokens"):
        table.extend(LEASE, [(sid, 1)], commits=[(sid, [7], 9)])
    assert snapshot(table) == before
    # Past max_model_len once the commit is counted: refused, and says so.
    with pytest.raises(InvalidArgument, match="after the call's commits"):
        table.extend(LEASE, [(sid, 57)], commits=[(sid, [7, 8], 8)])
    assert snapshot(table) == before
    table.check_invariants()


def test_free_and_swap_out_carrying_commits_publish_what_was_written_first() -> None:
    table = make_table(num_blocks=8)
    a = alloc(table, [1, 2, 3, 4, 5, 6, 7])  # 2 blocks
    b = alloc(table, [9, 9, 9, 9, 9])
    table.swap_out(LEASE, [b], commits=[(b, [9, 9, 9], 8)])
    assert table.get(b).num_computed_tokens == 8 and table.get(b).location == "host"
    assert table.free(LEASE, [a], commits=[(a, [8], 8)]) == 2
    assert table.lookup_prefix([([1, 2, 3, 4, 5, 6, 7, 8], "", "")]) == [8]
    # A refused free (an unknown id) applies no commit either.
    c = alloc(table, [3, 3, 3])
    with pytest.raises(NotFound):
        table.free(LEASE, [c, 999], commits=[(c, [3], 4)])
    assert table.get(c).token_ids == [3, 3, 3] and table.get(c).num_computed_tokens == 0
    table.check_invariants()
