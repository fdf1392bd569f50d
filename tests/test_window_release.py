"""Extend's releases: blocks a sliding window left behind go back to the cache (issue 24 item 3).

The table keeps their positions as placeholders; what was published stays a prefix hit; Free,
SwapOut / SwapIn, fencing, tenant counts and the invariants see only the blocks still held; a
bad release is INVALID_ARGUMENT (or the usual NotFound / PermissionDenied / FailedPrecondition)
and changes nothing.
"""

from __future__ import annotations

import pytest
import torch
from test_sequences import BS, LEASE, OTHER, alloc, assert_same, fill_pattern, make_table, snapshot

from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvtier.cachesvc.records import PLACEHOLDER_BLOCK
from kvtier.cachesvc.sequences import SequenceTable
from kvtier.sequence_types import ReleaseItem

PROMPT = list(range(1, 15))  # 14 tokens: blocks 0-2 full, block 3 holds two


def committed(table: SequenceTable, tokens: list[int] = PROMPT, **kw) -> int:
    """A sequence whose prompt is written and committed (its full blocks published)."""
    sid = alloc(table, tokens, **kw)
    table.commit(kw.get("lease", LEASE), [(sid, [], len(tokens))])
    return sid


def test_released_blocks_become_placeholders_and_stay_prefix_hits() -> None:
    table = make_table(num_blocks=8, host_blocks=None)
    sid = committed(table)
    held = list(table.get(sid).block_table)
    free_before = table.block_manager.num_free_blocks
    (blocks,) = table.extend(LEASE, [(sid, 1)], releases=[ReleaseItem(sid, 2)])
    assert blocks.block_table == [PLACEHOLDER_BLOCK, PLACEHOLDER_BLOCK, *held[2:]]
    assert blocks.num_slots == 4 * BS  # positions kept: the room is the same
    seq = table.get(sid)
    assert (seq.num_released_blocks, seq.num_blocks, seq.live_blocks) == (2, 2, held[2:])
    assert table.block_manager.num_free_blocks == free_before + 2
    assert table.stats.num_window_released_blocks == 2
    table.check_invariants()
    # Released, not forgotten: a new request with the same prompt hits all three full blocks.
    other = alloc(table, PROMPT, lease=OTHER)
    assert table.get(other).num_cached_tokens == 12
    assert table.get(other).block_table[:3] == held[:3]
    table.check_invariants()
    # Free releases only what is still held (a second free of a released block would raise).
    assert table.free(LEASE, [sid]) == 1  # block 2 is still shared with `other`
    table.check_invariants()


def test_a_release_at_or_below_what_is_released_changes_nothing() -> None:
    table = make_table(num_blocks=8, host_blocks=None)
    sid = committed(table)
    other = committed(table, [7] * 5)
    table.extend(LEASE, [(sid, 0)], releases=[(sid, 2)])
    before = snapshot(table)
    table.extend(LEASE, [(sid, 0)], releases=[(sid, 2), (other, 0)])
    table.extend(LEASE, [(sid, 0)], releases=[(sid, 1)])
    assert_same(before, snapshot(table))
    table.check_invariants()


def test_releases_count_the_commits_of_the_same_call() -> None:
    table = make_table(num_blocks=8, host_blocks=None)
    sid = alloc(table, PROMPT)  # nothing computed yet
    with pytest.raises(InvalidArgument, match="only 0 are committed"):
        table.extend(LEASE, [(sid, 0)], releases=[(sid, 1)])
    # The call's own commit writes the prompt first: then three blocks may go.
    (blocks,) = table.extend(LEASE, [(sid, 2)], commits=[(sid, [], 14)], releases=[(sid, 3)])
    assert blocks.block_table[:3] == [PLACEHOLDER_BLOCK] * 3
    assert table.block_manager.num_cached_blocks == 3  # published by the commit, still cached
    table.check_invariants()


def bad_releases(table: SequenceTable) -> dict[str, tuple[type[Exception], str, object]]:
    sid = committed(table)
    foreign = committed(table, [3] * 8, lease=OTHER)
    swapped = committed(table, [4] * 5)
    table.swap_out(LEASE, [swapped])
    return {
        "past-the-table": (InvalidArgument, r"releases\[0\].num_blocks = 5 is not in \[0, 4", [(sid, 5)]),
        "negative": (InvalidArgument, r"num_blocks = -1 is not in", [(sid, -1)]),
        "not-committed": (
            InvalidArgument,
            r"releases\[0\].num_blocks = 4 covers 16 tokens but only 14 are committed",
            [(sid, 4)],
        ),
        "duplicate": (
            InvalidArgument,
            r"releases\[1\].sequence_id = \d+ appears more than once",
            [(sid, 1)] * 2,
        ),
        "over-max-batch": (InvalidArgument, r"len\(releases\) = 9 exceeds max_batch 8", [(sid, 1)] * 9),
        "unknown": (
            NotFound,
            r"releases\[1\].sequence_id = 999 is not a live sequence",
            [(sid, 1), (999, 1)],
        ),
        "foreign": (
            PermissionDenied,
            r"releases\[0\].sequence_id = \d+ belongs to another lease",
            [(foreign, 1)],
        ),
        "swapped": (FailedPrecondition, r"releases\[0\].sequence_id = \d+ is swapped out", [(swapped, 1)]),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "past-the-table",
        "negative",
        "not-committed",
        "duplicate",
        "over-max-batch",
        "unknown",
        "foreign",
        "swapped",
    ],
)
def test_a_bad_release_is_refused_and_changes_nothing(kind: str) -> None:
    table = make_table(num_blocks=12, host_blocks=4)
    error, message, releases = bad_releases(table)[kind]
    sid = table.sequences()[0].sequence_id
    before = snapshot(table)
    with pytest.raises(error, match=message):
        # A commit and an extend ride along: neither is applied either.
        table.extend(LEASE, [(sid, 2)], commits=[(sid, [5], 14)], releases=releases)
    assert_same(before, snapshot(table))
    table.check_invariants()


def test_swap_round_trip_moves_only_live_blocks_and_keeps_positions() -> None:
    table = make_table(num_blocks=12, host_blocks=4)
    pool = table.host_area.pool
    sid = committed(table)
    table.extend(LEASE, [(sid, 0)], releases=[(sid, 2)])
    live = table.get(sid).live_blocks
    data = fill_pattern(pool, live, seed=7)
    assert table.swap_out(LEASE, [sid]) == (2, 2 * table.host_area.block_bytes)
    assert len(table.get(sid).tier_slots) == 2
    table.check_invariants()
    filler = alloc(table, [9] * 40)  # reuse the freed device blocks: a stale table reads garbage
    pool[table.get(filler).block_table] = -1.0
    table.free(LEASE, [filler])
    (view,), num_blocks, _ = table.swap_in(LEASE, [sid])
    assert num_blocks == 2
    assert view.block_table[:2] == [PLACEHOLDER_BLOCK] * 2 and len(view.block_table) == 4
    for block_id, expected in zip(view.block_table[2:], data, strict=True):
        assert torch.equal(pool[block_id], expected)
    seq = table.get(sid)
    assert seq.num_released_blocks == 2 and seq.num_published_blocks == 3
    table.check_invariants()
    # It continues: a commit past the swapped-in blocks publishes block 3, never a placeholder.
    table.extend(LEASE, [(sid, 0)], commits=[(sid, [15, 16], 16)])
    seq = table.get(sid)
    assert seq.num_published_blocks == 4
    assert table.block_manager.blocks[seq.block_table[3]].block_hash == seq.block_hashes[3]
    assert table.free(LEASE, [sid]) == 2
    table.check_invariants()


def test_fencing_and_tenant_counts_see_only_held_blocks() -> None:
    bm_blocks = 12
    # A quota makes the limits count incrementally (charged on release, not recounted).
    table = SequenceTable(
        BlockManager(bm_blocks, BS),
        None,
        model_fingerprint="fp",
        vocab_size=100,
        max_model_len=64,
        max_blocks_per_tenant=10,
    )
    sid = alloc(table, PROMPT, tenant="acme")
    table.commit(LEASE, [(sid, [], 13)])  # block 3 holds slot 13, not yet written
    table.extend(LEASE, [(sid, 0)], releases=[(sid, 3)])
    assert table.limits.tenant_blocks == {"acme": 1}
    table.check_invariants()
    # The lease expires: block 3 (an uncommitted slot) is fenced, the placeholders are skipped.
    assert table.free_lease(LEASE, fence_until=10.0) == 0
    assert table.fencing.num_fenced_blocks == 1
    table.check_invariants()
    assert table.fencing.release_fenced(now=10.0) == 1
    assert table.block_manager.num_free_blocks == bm_blocks
    table.check_invariants()
