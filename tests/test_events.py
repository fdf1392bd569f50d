"""EventLog: numbering, replay and the ring bound, fed by a real block manager's records."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtier.block_hash import extra_key, hash_full_blocks, hash_preimage, pack_token_ids
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.events import HOST_REPLACED, EventGap, EventLog, decode_events, tier_kind
from kvtier.cachesvc.host_cache import HostCache
from kvtier.cachesvc.kv_events_zmq import encode_record
from kvtier.cachesvc.servicer import event_to_proto
from kvtier.cachesvc.tiers import Blocks
from kvtier.sequence_types import CacheEvent
from kvtier.wire import event_from_proto

BS = 4
EXTRA = extra_key("model-fp")


def since(log: EventLog, event_id: int) -> list[CacheEvent]:
    """``log.since(event_id)`` as a WatchEvents reader gets it: each event through the servicer's
    message (event_to_proto) and the client's conversion of it (event_from_proto)."""
    return [event_from_proto(event_to_proto(i, event)) for i, event in log.since(event_id)]


def commit_chain(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """Allocate blocks for `tokens` and publish every full block in one call, as a commit does."""
    n = len(tokens) // BS
    table = bm.allocate(n)
    hashes: list[bytes] = []  # publish_blocks computes the missing hashes and appends them
    bm.publish_blocks(table, hashes, 0, n, tokens, EXTRA)
    assert hashes == hash_full_blocks(tokens, BS, EXTRA)
    return table, hashes


def test_a_commit_is_one_record_but_one_event_id_per_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    log = EventLog(BS)
    tokens = list(range(12))
    table, hashes = commit_chain(bm, tokens)
    records = bm.take_event_records()
    assert len(records) == 1
    log.extend(records)
    events = since(log, 0)
    assert [e.event_id for e in events] == [1, 2, 3]
    assert [e.event.block_id for e in events] == table
    assert [e.event.block_hash for e in events] == hashes
    assert [e.event.parent_block_hash for e in events] == [None, hashes[0], hashes[1]]
    assert [list(e.event.token_ids) for e in events] == [tokens[0:4], tokens[4:8], tokens[8:12]]
    # Replay from the middle of a record.
    assert [e.event_id for e in since(log, 1)] == [2, 3]
    assert since(log, 3) == []


def test_a_skipped_duplicate_splits_the_record_and_gets_no_event() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    log = EventLog(BS)
    tokens = list(range(12))
    hashes = hash_full_blocks(tokens, BS, EXTRA)
    first = bm.allocate(1)
    bm.publish_blocks(first, hashes, 0, 1, tokens, EXTRA)  # block 1 of the chain is already cached
    table = bm.allocate(3)
    assert bm.publish_blocks(table, hashes, 0, 3, tokens, EXTRA) == 2
    log.extend(bm.take_event_records())
    stored = [(e.event_id, e.event.block_id, e.event.parent_block_hash) for e in since(log, 0)]
    assert stored == [(1, first[0], None), (2, table[1], hashes[0]), (3, table[2], hashes[1])]


def test_evictions_follow_the_stores_they_undo_with_increasing_ids() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    log = EventLog(BS)
    table, hashes = commit_chain(bm, list(range(8)))
    bm.free(table[::-1])
    bm.allocate(2)  # the queue is dry: both cached blocks are evicted, tail first
    log.extend(bm.take_event_records())
    events = since(log, 0)
    assert [e.event_id for e in events] == [1, 2, 3, 4]
    assert [type(e.event).__name__ for e in events] == ["BlockStored"] * 2 + ["BlockRemoved"] * 2
    assert [e.event.block_hash for e in events[2:]] == [hashes[1], hashes[0]]


def test_the_ring_drops_whole_old_records_and_reports_the_gap() -> None:
    bm = BlockManager(num_blocks=64, block_size=BS)
    log = EventLog(BS, capacity=5)
    for k in range(4):  # four commits of three blocks: events 1..12
        commit_chain(bm, [100 * k + i for i in range(12)])
        log.extend(bm.take_event_records())
    assert log.last_event_id == 12
    # At least `capacity` newest events are kept, in whole records: 7..12.
    assert [e.event_id for e in since(log, 0)] == list(range(7, 13))
    assert [e.event_id for e in since(log, 6)] == list(range(7, 13))
    with pytest.raises(EventGap, match="since_event_id 5 is older than the oldest kept event 7"):
        log.since(5)


def test_watch_events_delivers_events_that_arrive_while_a_batch_is_being_sent() -> None:
    # The servicer's stream, driven by hand over real domain objects: it is suspended at a
    # `yield` (gRPC sending) when a commit publishes more blocks, and nothing is published after
    # that. The new events must still come, without waiting for a later publish.
    from kvtier.api import cache_pb2
    from kvtier.cachesvc.leases import LeaseTable
    from kvtier.cachesvc.node import CacheNode
    from kvtier.cachesvc.sequences import SequenceTable
    from kvtier.cachesvc.servicer import CacheServicer
    from kvtier.pool import PoolSpec
    from kvtier.sequence_types import AllocateItem

    async def scenario() -> list[int]:
        table = SequenceTable(
            BlockManager(num_blocks=16, block_size=BS),
            None,
            model_fingerprint="fp",
            vocab_size=100,
            max_model_len=64,
        )
        spec = PoolSpec("cpu-shm", "float16", [16, 1, 2, BS, 1, 8], [1] * 6, 16 * 256, BS)
        servicer = CacheServicer(CacheNode(table, LeaseTable(60.0)), spec)

        def commit(tokens: list[int]) -> None:
            (view,) = table.allocate("lease", [AllocateItem(tokens)])
            table.commit("lease", [(view.sequence_id, [], len(tokens))])
            servicer.node.events.extend(table.block_manager.take_event_records())

        commit(list(range(8)))  # events 1, 2
        stream = servicer.WatchEvents(cache_pb2.WatchEventsRequest(since_event_id=0), None)
        got = [event_from_proto(await anext(stream)).event_id]  # suspended after sending event 1
        commit(list(range(50, 58)))  # events 3, 4 arrive mid-batch; nothing is published after
        for _ in range(3):
            got.append(event_from_proto(await asyncio.wait_for(anext(stream), 2.0)).event_id)
        await stream.aclose()
        return got

    assert asyncio.run(scenario()) == [1, 2, 3, 4]


def test_watch_event_batches_say_which_batch_reaches_the_newest_event() -> None:
    # A replay longer than one message: the first batch is full and not caught up, the last is.
    from kvtier.api import cache_pb2
    from kvtier.cachesvc.leases import LeaseTable
    from kvtier.cachesvc.node import CacheNode
    from kvtier.cachesvc.sequences import SequenceTable
    from kvtier.cachesvc.servicer import WATCH_CHUNK, CacheServicer
    from kvtier.pool import PoolSpec
    from kvtier.sequence_types import AllocateItem

    blocks = WATCH_CHUNK + 44

    async def scenario() -> list[tuple[int, int, bool]]:
        table = SequenceTable(
            BlockManager(num_blocks=blocks, block_size=BS),
            None,
            model_fingerprint="fp",
            vocab_size=100,
            max_model_len=blocks * BS,
        )
        spec = PoolSpec("cpu-shm", "float16", [blocks, 1, 2, BS, 1, 8], [1] * 6, blocks * 256, BS)
        servicer = CacheServicer(CacheNode(table, LeaseTable(60.0)), spec)
        tokens = [i % 100 for i in range(blocks * BS)]
        (view,) = table.allocate("lease", [AllocateItem(tokens)])
        table.commit("lease", [(view.sequence_id, [], len(tokens))])
        servicer.node.events.extend(table.block_manager.take_event_records())
        request = cache_pb2.WatchEventBatchesRequest(since_event_id=0, omit_token_ids=True)
        stream = servicer.WatchEventBatches(request, None)
        got = []
        for _ in range(2):
            batch = await asyncio.wait_for(anext(stream), 2.0)
            assert not any(e.block_stored.token_ids for e in batch.events)
            got.append((batch.events[0].event_id, batch.events[-1].event_id, batch.caught_up))
        await stream.aclose()
        return got

    assert asyncio.run(scenario()) == [(1, WATCH_CHUNK, False), (WATCH_CHUNK + 1, blocks, True)]


def test_a_stream_started_with_the_held_blocks_knows_blocks_whose_events_the_log_dropped(monkeypatch) -> None:
    # A follower joining a cache whose log no longer keeps its first events: the held messages
    # (HELD_CHUNK hashes each, the last marked) carry every published block, and the events that
    # follow start right after the event they were taken at.
    from kvtier.api import cache_pb2
    from kvtier.cachesvc import servicer as servicer_module
    from kvtier.cachesvc.leases import LeaseTable
    from kvtier.cachesvc.node import CacheNode
    from kvtier.cachesvc.sequences import SequenceTable
    from kvtier.pool import PoolSpec
    from kvtier.sequence_types import AllocateItem

    monkeypatch.setattr(servicer_module, "HELD_CHUNK", 128)
    blocks = 300

    async def scenario():
        table = SequenceTable(BlockManager(num_blocks=2 * blocks, block_size=BS), None, model_fingerprint="fp",
                              vocab_size=100, max_model_len=blocks * BS)  # fmt: skip
        spec = PoolSpec("cpu-shm", "float16", [2 * blocks, 1, 2, BS, 1, 8], [1] * 6, blocks * 256, BS)
        node = CacheNode(table, LeaseTable(60.0), event_log_events=64)  # keeps the newest 64 events only
        servicer = servicer_module.CacheServicer(node, spec)

        def commit(seed: int, chains: int) -> set[bytes]:
            """``chains`` chains of 60 blocks, a commit (one record of 60 events) each."""
            hashes: set[bytes] = set()
            for chain in range(chains):
                tokens = [seed, chain] + [i % 100 for i in range(blocks // 5 * BS - 2)]
                (view,) = table.allocate("lease", [AllocateItem(tokens)])
                table.commit("lease", [(view.sequence_id, [], len(tokens))])
                servicer.node._logged(None)
                hashes.update(hash_full_blocks(tokens, BS, extra_key("fp")))
            return hashes

        first = commit(1, 5)
        assert servicer.node.events.since(0)[0][0] > blocks - 2 * 60  # event 1 is gone
        request = cache_pb2.WatchEventBatchesRequest(omit_token_ids=True, start_with_held=True)
        stream = servicer.WatchEventBatches(request, None)
        held = [await asyncio.wait_for(anext(stream), 2.0) for _ in range(3)]
        second = commit(2, 1)  # within what the log keeps after the held blocks' event
        after = await asyncio.wait_for(anext(stream), 2.0)
        await stream.aclose()
        return first, second, held, after

    first, second, held, after = asyncio.run(scenario())
    assert [(len(m.held[0].block_hashes), m.held_end, m.held_as_of_event_id, m.caught_up) for m in held] == [
        (128, False, blocks, False), (128, False, blocks, False), (blocks - 256, True, blocks, True)
    ]  # fmt: skip
    assert {m.held[0].medium for m in held} == {"device"} and not any(m.events for m in held)
    assert {h for m in held for h in m.held[0].block_hashes} == first
    assert [e.event_id for e in after.events] == list(range(blocks + 1, blocks + 61)) and not after.held
    assert {e.block_stored.block_hash for e in after.events} == second


def chain_keys(tokens: list[int]) -> tuple[list[bytes], list[bytes]]:
    """The index keys (``parent || token bytes``) and hashes of ``tokens``' full blocks."""
    data = pack_token_ids(tokens)
    keys, parent = [], EXTRA
    for b in range(len(tokens) // BS):
        keys.append(parent + data[b * 4 * BS : (b + 1) * 4 * BS])
        parent = hash_preimage(keys[-1])
    hashes = hash_full_blocks(tokens, BS, EXTRA)
    assert [hash_preimage(k) for k in keys] == hashes
    return keys, hashes


def test_a_lower_tiers_records_hold_keys_and_read_as_events_with_their_medium() -> None:
    tokens = list(range(3 * BS))
    keys, hashes = chain_keys(tokens)
    log = EventLog(BS)
    log.extend([
        (tier_kind(True, "host"), tuple(keys), (0, 1, 2)),
        (tier_kind(False, "host"), (keys[2],), (2,)),
        (tier_kind(True, "disk"), (keys[1],), (-1,)),
    ])  # fmt: skip
    events = since(log, 0)
    assert [(e.event.medium, e.event.block_hash) for e in events[:3]] == [("host", h) for h in hashes]
    assert [e.event.parent_block_hash for e in events[:3]] == [EXTRA, hashes[0], hashes[1]]
    assert list(events[1].event.token_ids) == tokens[BS : 2 * BS]
    assert (events[3].event.medium, events[3].event.block_hash) == ("host", hashes[2])
    assert (events[4].event.medium, events[4].event.block_id) == ("disk", -1)
    assert [e.event_id for e in since(log, 2)] == [3, 4, 5]  # from the middle of a record
    # The ZMQ form: a BlockStored per block (each with its parent), vLLM's media.
    stored = encode_record((tier_kind(True, "host"), tuple(keys[:2]), (0, 1)), BS, "GPU")
    assert (
        [list(e.values()) for e in stored]
        == [  # vLLM's tagged maps, fields in its order
            ["BlockStored", [hashes[0]], EXTRA, tokens[:BS], BS, None, "CPU", None],
            ["BlockStored", [hashes[1]], hashes[0], tokens[BS : 2 * BS], BS, None, "CPU", None],
        ]
    )
    assert encode_record((tier_kind(False, "disk"), (keys[2],), (-1,)), BS, "GPU") == [
        {"type": "BlockRemoved", "block_hashes": [hashes[2]], "medium": "STORAGE"}
    ]
    # Knowing the chain's salt (the publisher asks the cache's ExtraKeys), a first block is a
    # root (no parent) carrying its salt, as vLLM's cache_salt.
    salted = encode_record((tier_kind(True, "host"), tuple(keys[:2]), (0, 1)), BS, "GPU", {EXTRA: "s"}.get)
    assert [(e["parent_block_hash"], e.get("extra_keys")) for e in salted] == [
        (None, [["s"]]),
        (hashes[0], None),
    ]


def test_a_host_eviction_batch_is_one_record_read_as_its_removals_then_its_stores() -> None:
    """keep_rows on a full host cache records the victims and the blocks that took their slots as
    one HOST_REPLACED record; WatchEvents (from any event id) and the ZMQ form read it exactly as
    the two records it replaces (a store that hands its evictions down records those two)."""
    tokens = list(range(5 * BS))
    keys, hashes = chain_keys(tokens)
    logs = []
    for one_record in (True, False):
        host, rows = HostCache(2, 16), torch.zeros((8, 16), dtype=torch.uint8)

        def keep(ids, ks, host=host, rows=rows, down=not one_record):
            host.submit_store(Blocks(ks, rows, ids), pass_down=down)  # down: removals, then stores

        keep([0, 1], keys[:2])  # free slots 0, 1
        keep([2, 3], keys[2:4])  # a full cache: keys 0, 1 leave slots 0, 1 to keys 2, 3
        keep([4], keys[4:])  # one block: key 2 leaves slot 0 to key 4
        records = host.take_events()
        assert [r[0] == HOST_REPLACED for r in records] == (
            [False, True, True] if one_record else [False] * 5
        )
        log = EventLog(BS)
        log.extend(records)
        logs.append((log, records))
    (log, records), (two_log, two_records) = logs
    expected = [
        ("BlockStored", hashes[0], 0),
        ("BlockStored", hashes[1], 1),
        ("BlockRemoved", hashes[0], 0),
        ("BlockRemoved", hashes[1], 1),
        ("BlockStored", hashes[2], 0),
        ("BlockStored", hashes[3], 1),
        ("BlockRemoved", hashes[2], 0),
        ("BlockStored", hashes[4], 0),
    ]
    for start in range(len(expected) + 1):
        got = since(log, start)
        assert got == since(two_log, start)
        assert [e.event_id for e in got] == list(range(start + 1, len(expected) + 1))
        read = [(type(e.event).__name__, e.event) for e in got]
        assert [(kind, m.block_hash, m.block_id, m.medium) for kind, m in read] == [
            (*event, "host") for event in expected[start:]
        ]
        for stop in range(start, len(expected) + 1):  # any slice of the log's second record
            one = decode_events(records[1], BS, max(start - 2, 0), max(stop - 2, 0))
            two = [e for r in two_records[1:3] for e in decode_events(r, BS)][
                max(start - 2, 0) : max(stop - 2, 0)
            ]
            assert one == two
    assert [e for r in records for e in encode_record(r, BS, "GPU")] == [
        e for r in two_records for e in encode_record(r, BS, "GPU")
    ]


def test_hash_runs_carry_every_event_of_any_slice_of_the_log_as_since_reads_it() -> None:
    """``runs_since`` (WatchEventBatches' hashes_only) against ``since``: from any event id and in
    chunks of any size, the runs expand to the same event ids, media, kinds and hashes, over
    every kind of record (a device commit and eviction, a lower tier's stores and removals, a
    host HOST_REPLACED record); and the client groups a CacheEvent stream into the same runs."""
    from kvtier.cache_streams import runs_of
    from kvtier.sequence_types import BlockStored

    bm = BlockManager(num_blocks=3, block_size=BS)
    tokens = list(range(5 * BS))
    keys, hashes = chain_keys(tokens)
    table, _ = commit_chain(bm, tokens[: 3 * BS])  # device: 3 stores in one record
    bm.free(table[::-1])
    bm.allocate(2)  # device: the chain's last two blocks evicted (one record)
    host = HostCache(2, 16)
    rows = torch.zeros((8, 16), dtype=torch.uint8)
    host.submit_store(Blocks(keys[:2], rows, [0, 1]), pass_down=False)
    host.submit_store(Blocks(keys[2:4], rows, [2, 3]), pass_down=False)  # one HOST_REPLACED record
    records = bm.take_event_records() + host.take_events() + [(tier_kind(False, "disk"), (keys[4],), (-1,))]
    assert any(r[0] == HOST_REPLACED for r in records)
    log = EventLog(BS)
    log.extend(records)
    every = [(i, e.medium, isinstance(e, BlockStored), e.block_hash) for i, e in log.since(0)]
    assert len(every) == log.last_event_id == 3 + 2 + 2 + 4 + 1
    for start in range(log.last_event_id + 1):
        for chunk in (1, 2, 3, 5, None):
            runs = log.runs_since(start, chunk)
            expanded = [(first + k, m, stored, h) for first, m, stored, hs in runs for k, h in enumerate(hs)]
            assert expanded == every[start : None if chunk is None else start + chunk]
            assert all(runs) and all(len(run[3]) for run in runs)
    grouped = runs_of([CacheEvent(i, e) for i, e in log.since(0)])
    assert [tuple(r) for r in grouped] == log.runs_since(0)
    assert len(grouped) == 6  # device stores, device removals, host stores, host removals, host stores, disk
