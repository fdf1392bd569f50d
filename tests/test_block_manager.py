"""BlockManager and block hashing: LRU free queue, prefix index, eviction order, determinism."""

from __future__ import annotations

import hashlib
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import bench_script

from kvtier.block_hash import InvalidHashInput, extra_key, hash_block, hash_full_blocks, pack_token_ids
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import InvalidArgument, ResourceExhausted
from kvtier.cachesvc.events import BlockRemoved, BlockStored
from kvtier.cachesvc.free_queue import Block, FreeBlockQueue

ROOT = Path(__file__).resolve().parent.parent
EXTRA = extra_key("model-fp", "salt", "adapter")


def publish_chain(bm: BlockManager, block_ids: list[int], tokens: list[int]) -> list[bytes]:
    """Publish ``block_ids`` as the full blocks of ``tokens`` (as Commit would); return the hashes."""
    bs = bm.block_size
    hashes = hash_full_blocks(tokens, bs, EXTRA)
    for j, (block_id, h) in enumerate(zip(block_ids, hashes, strict=False)):
        assert bm.publish(block_id, hashes[j - 1] if j else None, tokens[j * bs : (j + 1) * bs], EXTRA) == h
    return hashes


def cached(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Block ids of the longest cached prefix of ``tokens`` (whole blocks, no cap)."""
    return bm.match_prefix(pack_token_ids(tokens), EXTRA, len(tokens))[0]


# ---------------------------------------------------------------------- hashing


def test_hash_matches_documented_formula() -> None:
    tokens = [1, 2, 3, 70000, 5, 6, 7, 8]
    extra = hashlib.sha256(b"kvtier-block-v1\0" + b"m\0s\0a").digest()
    assert extra_key("m", "s", "a") == extra
    # The extra key is the first block's parent; later blocks inherit it through the chain.
    first = hashlib.sha256(extra + struct.pack("<4i", 1, 2, 3, 70000)).digest()
    second = hashlib.sha256(first + struct.pack("<4i", 5, 6, 7, 8)).digest()
    assert hash_full_blocks(tokens, 4, extra) == [first, second]
    assert hash_block(None, tokens[:4], extra) == first
    assert hash_block(first, tokens[4:], extra) == second
    assert pack_token_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_hash_full_blocks_ignores_partial_block_and_chains_from_start_parent() -> None:
    tokens = list(range(23))
    hashes = hash_full_blocks(tokens, 4, EXTRA)
    assert len(hashes) == 5
    assert all(len(h) == 32 for h in hashes)
    # Resuming at a block boundary from the previous hash gives the same chain.
    assert hash_full_blocks(tokens[8:], 4, EXTRA, start_parent=hashes[1]) == hashes[2:]
    assert hash_full_blocks(pack_token_ids(tokens), 4, EXTRA) == hashes
    assert hash_full_blocks([1, 2, 3], 4, EXTRA) == []


def test_hash_depends_on_salt_adapter_model_and_whole_prefix() -> None:
    tokens = list(range(8))
    base = hash_full_blocks(tokens, 4, extra_key("m"))
    assert hash_full_blocks(tokens, 4, extra_key("m", "tenant-b")) != base
    assert hash_full_blocks(tokens, 4, extra_key("m", "", "lora-1")) != base
    assert hash_full_blocks(tokens, 4, extra_key("m2")) != base
    # Same second block, different first block: the chain makes the second hash differ too.
    other = hash_full_blocks([9, 1, 2, 3, 4, 5, 6, 7], 4, extra_key("m"))
    assert other[1] != base[1]


def test_extra_key_rejects_nul_in_a_field() -> None:
    with pytest.raises(InvalidHashInput, match="cache_salt"):
        extra_key("m", "a\0b")


def test_hash_is_deterministic_across_processes() -> None:
    tokens = [(i * 7919) % 50257 for i in range(100)]
    code = (
        "from kvtier.block_hash import extra_key, hash_full_blocks\n"
        f"print(','.join(h.hex() for h in hash_full_blocks({tokens!r}, 16, extra_key('fp', 'salt', 'ad'))))"
    )
    expected = ",".join(h.hex() for h in hash_full_blocks(tokens, 16, extra_key("fp", "salt", "ad")))
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected, f"hashes differ under PYTHONHASHSEED={seed}"


# ---------------------------------------------------------------------- free queue and counters


def test_new_manager_has_every_block_free_in_id_order() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.free_block_ids() == [0, 1, 2, 3, 4]
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.num_cached_blocks) == (5, 0, 0)
    assert bm.allocate(2) == [0, 1]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (3, 2)
    bm.check_invariants([[0, 1]])


def test_touch_removes_a_free_block_from_the_middle_of_the_queue() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    bm.touch([2])
    assert bm.free_block_ids() == [0, 1, 3, 4]
    assert bm.ref_count(2) == 1
    bm.touch([2])
    assert bm.ref_count(2) == 2
    assert bm.free([2, 2]) == 1
    assert bm.free_block_ids() == [2, 0, 1, 3, 4]  # unpublished: to the head, reused first
    bm.check_invariants([])


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate(2)
    with pytest.raises(ResourceExhausted, match="need 2 blocks but only 1 of 3 are free"):
        bm.allocate(2)
    assert bm.free_block_ids() == [2]
    bm.check_invariants([[0, 1]])


def test_can_allocate_counts_touched_free_blocks_once() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.can_allocate(4)
    assert bm.can_allocate(3, [1, 1])  # touching block 1 (twice) takes one block out of the queue
    assert not bm.can_allocate(4, [1])
    assert bm.can_allocate(0)


def test_free_of_unreferenced_block_raises_and_is_undone() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(3)
    with pytest.raises(InvalidArgument, match=r"block_ids\[2\] = 3 is not referenced"):
        bm.free([2, 1, 3])
    assert bm.free_block_ids() == [3]
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 1, 0]
    bm.check_invariants([[0, 1, 2]])


def test_free_of_a_block_named_more_often_than_it_is_referenced_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(2)
    bm.touch([1])  # block 1: ref_cnt 2
    with pytest.raises(InvalidArgument, match=r"block_ids\[3\] = 0 is not referenced"):
        bm.free([1, 0, 1, 0])
    assert [bm.ref_count(i) for i in range(4)] == [1, 2, 0, 0]
    assert bm.free_block_ids() == [2, 3]
    assert bm.free([1, 1, 0]) == 2
    assert bm.free_block_ids() == [1, 0, 2, 3]  # unpublished blocks go to the head
    bm.check_invariants([])


@pytest.mark.parametrize("others_free", [0, 2])
def test_free_sends_published_blocks_to_the_tail_and_unpublished_ones_to_the_head(others_free) -> None:
    """vLLM's order: a block worth nothing to the prefix cache is reused before any cached one,
    so cached blocks live longer. With an empty queue both runs meet in the middle."""
    bm = BlockManager(num_blocks=6 + others_free, block_size=4)
    ids = bm.allocate(6)
    publish_chain(bm, ids[:3], list(range(12)))  # ids[0..2] published, ids[3..5] not
    bm.take_events()
    assert bm.free(ids[::-1]) == 6  # a block table is freed reversed
    expected = [ids[5], ids[4], ids[3], *range(6, 6 + others_free), ids[2], ids[1], ids[0]]
    assert bm.free_block_ids() == expected
    bm.check_invariants([])
    # The next allocation takes the unpublished blocks and evicts nothing.
    assert bm.allocate(3) == ids[5:2:-1]
    assert bm.num_evictions == 0 and bm.take_events() == []


def test_an_over_free_among_published_and_unpublished_blocks_is_undone_to_the_link() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    ids = bm.allocate(5)
    publish_chain(bm, ids[:2], list(range(8)))
    before = bm.free_block_ids()
    bm.free([ids[4]])
    with pytest.raises(InvalidArgument, match=rf"block_ids\[4\] = {ids[4]} is not referenced"):
        bm.free([ids[3], ids[1], ids[2], ids[0], ids[4]])
    assert [bm.ref_count(i) for i in ids] == [1, 1, 1, 1, 0]
    assert bm.free_block_ids() == [ids[4], *before]
    bm.check_invariants([ids[:4]])


def test_free_queue_batch_operations_keep_lru_order() -> None:
    blocks = [Block(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    ids: list[int] = []
    assert queue.pop_acquire_n(2, ids) == [] and ids == [0, 1]  # nothing cached to evict
    queue.acquire(blocks, [3, 5])  # taken from the middle
    assert queue.block_ids() == [2, 4]
    blocks[5].block_hash = blocks[0].block_hash = b"h"  # published: released to the tail
    assert queue.release(blocks, [5, 0, 1, 3]) == 4  # unpublished 1, 3: to the head
    assert queue.block_ids() == [1, 3, 2, 4, 5, 0]
    assert queue.num_free == 6 and all(b.ref_cnt == 0 for b in blocks)
    assert [b.block_id for b in queue.check_links()] == [1, 3, 2, 4, 5, 0]


# ---------------------------------------------------------------------- prefix index and eviction


def test_published_blocks_are_found_by_match_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    ids = bm.allocate(3)
    hashes = publish_chain(bm, ids[:2], tokens)
    assert bm.num_cached_blocks == 2
    assert bm.match_prefix(pack_token_ids(tokens), EXTRA, 3) == (ids[:2], hashes[:2])
    assert bm.match_prefix(pack_token_ids(tokens), EXTRA, 1) == (ids[:1], hashes[:1])
    assert cached(bm, [0, 1, 2, 3, 9, 9, 9, 9]) == ids[:1]
    assert cached(bm, [5] * 8) == []
    assert bm.match_prefix(pack_token_ids(tokens), extra_key("model-fp", "other-salt", "adapter"), 3) == (
        [],
        [],
    )
    events = bm.take_events()
    assert events == [
        BlockStored(hashes[0], None, ids[0], [0, 1, 2, 3]),
        BlockStored(hashes[1], hashes[0], ids[1], [4, 5, 6, 7]),
    ]
    assert bm.take_events() == []


def test_publish_keeps_the_first_block_indexed_and_files_a_duplicate_as_its_copy() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = bm.allocate(2)
    h = hash_block(None, [1, 2, 3, 4], EXTRA)
    assert bm.publish(a, None, [1, 2, 3, 4], EXTRA) == h
    assert bm.publish(b, None, [1, 2, 3, 4], EXTRA) is None  # not newly published: a copy
    assert bm.block_hash(b) == h
    assert cached(bm, [1, 2, 3, 4]) == [a]
    assert bm.num_cached_blocks == 1
    assert bm.take_events() == [BlockStored(h, None, a, [1, 2, 3, 4])]  # one hash, one event
    # A block that already carries a hash is not re-keyed.
    assert bm.publish(a, None, [5, 6, 7, 8], EXTRA) is None
    assert bm.block_hash(a) == h
    bm.check_invariants([[a], [b]])


def test_duplicate_content_stays_findable_while_any_copy_lives() -> None:
    """Three requests commit the same new block at once (all missed): evicting the indexed
    block hands the hash to a copy without an event; only the last copy's eviction removes it."""
    bm = BlockManager(num_blocks=4, block_size=4)
    ids = bm.allocate(3)
    tokens = [7, 7, 7, 7]
    h = hash_block(None, tokens, EXTRA)
    for block_id in ids:
        bm.publish(block_id, None, tokens, EXTRA)
    bm.take_events()
    bm.free([ids[0]])  # the indexed one is freed first, then evicted first
    bm.free([ids[2]])
    assert bm.allocate(2) == [3, ids[0]]  # the never-used block, then the indexed copy
    assert bm.take_events() == []  # the hash is still stored: a copy took its place
    assert bm.block_hash(ids[0]) is None
    assert bm.num_evictions == 1
    assert cached(bm, tokens) in ([ids[1]], [ids[2]])
    bm.check_invariants([[3], [ids[0]], [ids[1]]])
    assert bm.allocate(1) == [ids[2]]  # evict the free copy (indexed or not)
    assert bm.take_events() == [] and cached(bm, tokens) == [ids[1]]
    bm.free([ids[1]])
    bm.free([3, ids[0], ids[2]])
    bm.allocate(4)  # the last copy goes: now the hash is removed
    assert bm.take_events() == [BlockRemoved(h, ids[1])]
    assert cached(bm, tokens) == [] and bm.copies == {}
    bm.check_invariants([[0, 1, 2, 3]])


def test_allocate_one_takes_evicts_and_reports_exactly_as_allocate_of_one() -> None:
    """Extend's one-block path (``allocate_one``) against ``allocate(1)`` on a twin with the same
    history: a chain, a duplicate block (a copy), unpublished blocks; block by block until the
    pool runs dry, the same ids, evictions, events, returned evictions, index and copies."""
    twins = [BlockManager(num_blocks=8, block_size=4), BlockManager(num_blocks=8, block_size=4)]
    returned: list[list] = [[], []]  # per twin: take_evicted() after each block
    for bm in twins:
        bm.keep_evicted = True  # what a table with tiers below sets: evictions are returned
        table = bm.allocate(5)
        publish_chain(bm, table[:3], list(range(12)))
        bm.publish(table[3], None, [0, 1, 2, 3], EXTRA)  # the chain's first block again: a copy
        bm.free([table[4], *table[3::-1]])  # the unpublished block to the head, the rest behind
        bm.take_events()
    single, batch = twins
    taken = []
    while batch.num_free_blocks:
        got = single.allocate_one()
        assert [got] == batch.allocate(1)
        taken.append(got)
        for bm, out in zip(twins, returned, strict=True):
            ids, keys = bm.take_evicted()
            if ids:
                out.append((ids, keys))
        assert single.take_events() == batch.take_events()
        assert returned[0] == returned[1] and single.num_evictions == batch.num_evictions
        assert single.free_block_ids() == batch.free_block_ids()
        assert (
            single.prefix_index.keys() == batch.prefix_index.keys()
            and single.copies.keys() == batch.copies.keys()
        )
        single.check_invariants([[i] for i in taken])
    assert single.num_evictions == 4 and len(returned[0]) == 3  # the copy's eviction hands its hash on
    with pytest.raises(ResourceExhausted, match="need 1 blocks but only 0 of 8 are free"):
        single.allocate_one()
    single.check_invariants([[i] for i in taken])


def test_reset_prefix_cache_drops_copies_too() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = bm.allocate(2)
    bm.publish(a, None, [1, 2, 3, 4], EXTRA)
    bm.publish(b, None, [1, 2, 3, 4], EXTRA)
    bm.free([a, b])
    bm.take_events()
    assert bm.reset_prefix_cache()
    assert bm.block_hash(b) is None and bm.copies == {} and bm.num_cached_blocks == 0
    assert len(bm.take_events()) == 1
    bm.check_invariants([])


def test_tail_of_a_chain_is_evicted_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(16))
    table = bm.allocate(4)
    hashes = publish_chain(bm, table, tokens)
    bm.free(table[::-1])
    assert bm.free_block_ids() == table[::-1]
    bm.take_events()
    got = bm.allocate(1)
    assert got == [table[3]]
    assert bm.take_events() == [BlockRemoved(hashes[3], table[3])]
    assert cached(bm, tokens) == table[:3]
    assert bm.num_evictions == 1
    bm.check_invariants([got])


def test_cached_blocks_are_evicted_only_when_the_free_queue_runs_dry() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    table = bm.allocate(2)
    publish_chain(bm, table, tokens)
    bm.free(table[::-1])
    # Six never-used blocks sit ahead of the cached ones in the queue.
    other = bm.allocate(6)
    assert set(other).isdisjoint(table)
    assert bm.num_evictions == 0
    assert cached(bm, tokens) == table
    last = bm.allocate(1)
    assert last == [table[1]]
    assert bm.num_evictions == 1
    assert cached(bm, tokens) == table[:1]
    bm.check_invariants([other, last])


def test_touching_a_cached_free_block_protects_it_from_eviction() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    table = bm.allocate(1)
    publish_chain(bm, table, [1, 2, 3, 4])
    bm.free(table)
    bm.touch(cached(bm, [1, 2, 3, 4]))
    assert bm.allocate(2) == [1, 2]
    with pytest.raises(ResourceExhausted):
        bm.allocate(1)
    assert bm.num_evictions == 0
    bm.check_invariants([table, [1], [2]])


def test_reset_prefix_cache_refuses_while_a_block_is_referenced() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    table = bm.allocate(2)
    publish_chain(bm, table, list(range(8)))
    bm.take_events()
    assert not bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 2
    bm.free(table[::-1])
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert cached(bm, list(range(8))) == []
    assert {e.block_id for e in bm.take_events() if isinstance(e, BlockRemoved)} == set(table)
    assert bm.num_evictions == 0
    bm.check_invariants([])


def test_check_invariants_names_a_wrong_ref_count() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    table = bm.allocate(2)
    with pytest.raises(AssertionError, match="block 1: ref_cnt 1 but 0 block tables hold it"):
        bm.check_invariants([table[:1]])
    bm.blocks[3].ref_cnt = 1
    with pytest.raises(AssertionError, match="block 3 is in the free queue with ref_cnt 1"):
        bm.check_invariants([table])


def test_a_block_hits_only_on_its_own_exact_tokens_even_if_hashes_collide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With a hash under which every block collides, a block still hits only on its own exact
    # tokens: the index compares preimages. (What comes before a block is still known only by
    # the parent's digest, as in any hash chain.)
    class Collide:
        def __init__(self, data: bytes) -> None:
            pass

        def digest(self) -> bytes:
            return b"\x00" * 32

    monkeypatch.setattr("kvtier.block_hash._sha256", Collide)
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    table = bm.allocate(2)
    assert bm.publish_blocks(table, [], 0, 2, tokens, EXTRA) == 2
    assert cached(bm, tokens) == table
    assert cached(bm, [1, 2, 3, 4, 9, 9, 9, 9]) == table[:1]
    assert cached(bm, [9, 2, 3, 4, 5, 6, 7, 8]) == []


# ---------------------------------------------------------------------- the pressure trace


def test_pressure_trace_evicts_only_what_the_unpublished_free_blocks_cannot_cover() -> None:
    """bench/block_manager.py's pressure trace, small: the policy evicts a cached block only when
    no unpublished free block is left, and hits at least as many tokens as the policy before it
    (every freed block to the tail, duplicates never offered), which broke that bound."""
    bench = bench_script("block_manager")

    args = bench.parse_args(["--sequences", "160", "--decode", "8", "--wave", "8"])
    args.prefixes, args.prefix_len, args.prompt_len = 24, 64, 100  # a partial last block per prompt
    trace = bench.make_trace(args)
    num_blocks = 8 * 8 + 24 * 64 // 16 // 2
    now, before = (bench.pressure_replay(args, trace, policy, num_blocks) for policy in bench.POLICIES)
    assert now.evictions > 0, "the pool must be under pressure for this test to mean anything"
    assert now.evictions == now.max_evictions
    assert before.evictions > before.max_evictions
    assert now.hit_tokens >= before.hit_tokens > 0


@pytest.mark.parametrize("tiers", [[], ["--tiers", "both"]], ids=["tiers-off", "each-tree-its-host-cache"])
def test_the_before_after_bench_runs_two_trees_in_one_process(tiers: list[str]) -> None:
    """bench/block_manager_ab.py, small: HEAD's packages against the working tree's, side by side
    (with ``--tiers both``, each tree over its own host cache, whose figures it prints)."""
    repo = Path(__file__).resolve().parent.parent
    if subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: the bench exports a revision with git archive")
    out = subprocess.run(
        [
            sys.executable,
            str(repo / "bench" / "block_manager_ab.py"),
            "--before",
            "HEAD",
            "--quick",
            "--repeats",
            "1",
            *tiers,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    rows = {m[1]: m[2].split() for m in re.finditer(r"^(before|after) +([\d. ]+)$", out, re.M)}
    assert set(rows) == {"before", "after"}, out
    assert all(len(v) == 6 and float(v[0]) > 0 for v in rows.values()), out
    host = re.findall(r"^(before|after)'s host cache, last run: (\d+) blocks stored", out, re.M)
    assert [name for name, _ in host] == (["before", "after"] if tiers else []), out
    assert all(int(stored) > 0 for _, stored in host), out
    headline = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"headline: after [\d.]+ vs before [\d.]+ µs per lifecycle, after/before [\d.]+", headline
    )
