"""Prefix-index events (BlockStored / BlockRemoved) and the bounded, numbered log `WatchEvents` reads.

Domain types only: the servicer turns ``(event_id, event)`` pairs into ``CacheEvent`` messages.
"""

from __future__ import annotations

import asyncio
import itertools
from bisect import bisect_right
from collections import deque
from collections.abc import Callable

from kvtier.block_hash import BlockHash, hash_preimage, unpack_block
from kvtier.cachesvc.disk_records import KEY_PREFIX_BYTES
from kvtier.cachesvc.errors import CacheError
from kvtier.media import names as media_names
from kvtier.sequence_types import (  # WatchEvents' values, shared with its clients
    BlockEvent,
    BlockRemoved,
    BlockStored,
)

REMOVED = 0
STORED = 1
MEDIUMS = media_names()
"""The media of ``kvtier.media``, by rank. A record's kind is ``STORED | REMOVED`` plus ``2 * ``
its medium's rank: the device's records keep kinds 0 and 1 (the block manager's hot path is
unchanged), the host tier's are 2 and 3, the disk tier's 4 and 5 (``tier_kind``)."""


def tier_kind(stored: bool, medium: str) -> int:
    """The EventRecord kind of a block entering (``stored``) or leaving ``medium``."""
    return (STORED if stored else REMOVED) + 2 * MEDIUMS.index(medium)


HOST_REPLACED = 2 * len(MEDIUMS)
"""The kind of a host-cache record of new blocks that took the slots of as many evicted ones,
one per eviction batch (``HostCache.keep_rows``): ``(HOST_REPLACED, victims + keys,
slots)``, read as the host's REMOVED record of the victims, then its STORED record of the keys
(``split_replaced``); one record instead of two per Allocate or Extend that evicts."""


def split_replaced(record: EventRecord) -> tuple[EventRecord, EventRecord]:
    """A HOST_REPLACED record as the host's REMOVED record and STORED record it stands for."""
    _, keys, slots = record
    n = len(slots)
    return (tier_kind(False, "host"), keys[:n], slots), (tier_kind(True, "host"), keys[n:], slots)


EventRecord = tuple
"""How the block manager records events on its hot path, without an object per block:

- ``(REMOVED, hashes, block_ids)``: a BlockRemoved per entry of the two tuples.
- ``(STORED, hashes, block_ids, token_bytes, parent, extra)``: a BlockStored per entry of the
  tuples ``hashes`` and ``block_ids``, a run of consecutive blocks of one chain; block i's token
  ids are block i of ``token_bytes`` (``pack_token_ids`` form), its parent ``parent`` for i == 0
  and ``hashes[i - 1]`` after; ``extra`` is the chain's extra key (its root: model, tenant salt,
  adapter), which the ZMQ publisher turns back into the salt of a chain's first block.

A commit costs one STORED record, an allocation that evicts one REMOVED record. A lower tier's
record is ``(tier_kind(stored, medium), keys, block_ids)``: its blocks' index keys (``parent ||
token bytes``), hashed only when the record is read (``lower_tier_blocks``), so the eviction
that records it pays no SHA-256; a block's parent is its key's first 32 bytes (the parent's
hash, or the chain's extra key for a first block), its block id the host slot (-1 on disk,
which has no block ids); the host's evictions that make room for new blocks and those blocks
are one ``HOST_REPLACED`` record. Records hold only tuples, bytes, ints and None, so the garbage collector stops tracking them: a log of
thousands of them costs no GC time.
"""


def num_events(record: EventRecord) -> int:
    """How many events an EventRecord stands for."""
    return len(record[1])


def decode_events(
    record: EventRecord, block_size: int, start: int = 0, stop: int | None = None
) -> list[BlockEvent]:
    """The ``BlockStored`` / ``BlockRemoved`` events an ``EventRecord`` stands for, in order
    (those numbered ``start`` to ``stop`` within the record, by default all)."""
    if record[0] == HOST_REPLACED:
        removed, stored = split_replaced(record)
        n = len(removed[1])
        stop = 2 * n if stop is None else stop
        return decode_events(removed, block_size, min(start, n), min(stop, n)) + decode_events(
            stored, block_size, max(start - n, 0), max(stop - n, 0)
        )
    medium = MEDIUMS[record[0] >> 1]
    if record[0] > STORED:
        blocks = lower_tier_blocks(record, start, stop)
        if record[0] & 1 == REMOVED:
            return [BlockRemoved(h, i, medium) for h, _, i, _ in blocks]
        return [BlockStored(h, p, i, unpack_block(t, block_size, 0), medium) for h, p, i, t in blocks]
    if record[0] & 1 == REMOVED:
        pairs = zip(record[1][start:stop], record[2][start:stop], strict=True)
        return [BlockRemoved(h, i, medium) for h, i in pairs]
    _, hashes, block_ids, token_bytes, parent = record[:5]
    if start:
        parent = hashes[start - 1]
    events: list[BlockEvent] = []
    for i in range(start, len(hashes) if stop is None else min(stop, len(hashes))):
        block_hash = hashes[i]
        tokens = unpack_block(token_bytes, block_size, i)
        events.append(BlockStored(block_hash, parent, block_ids[i], tokens, medium))
        parent = block_hash
    return events


def lower_tier_blocks(
    record: EventRecord, start: int = 0, stop: int | None = None
) -> list[tuple[BlockHash, bytes, int, bytes]]:
    """``(hash, parent, block id, token bytes)`` of a lower tier's record's blocks ``start`` to
    ``stop`` (its keys hashed here)."""
    pairs = zip(record[1][start:stop], record[2][start:stop], strict=True)
    return [(hash_preimage(k), k[:KEY_PREFIX_BYTES], i, k[KEY_PREFIX_BYTES:]) for k, i in pairs]


HashRun = tuple
"""``(first event id, medium, stored, hashes)``: consecutive events of one medium and kind, event
``first + i`` about ``hashes[i]`` (``stored``: BlockStored, else BlockRemoved); ``EventLog.runs_since``."""


def hash_runs(record: EventRecord, start: int = 0, stop: int | None = None) -> list[HashRun]:
    """The events ``start`` to ``stop`` of an ``EventRecord`` as ``HashRun``s, numbered from 0 at
    the record's first event: one run, or two for a HOST_REPLACED record (its removals, then its
    stores); none empty. A device record's hashes are its own; a lower tier's keys are hashed here."""
    if record[0] == HOST_REPLACED:
        removed, stored = split_replaced(record)
        n = len(removed[1])
        stop = 2 * n if stop is None else stop
        return hash_runs(removed, min(start, n), min(stop, n)) + [
            (n + first, medium, kind, hashes)
            for first, medium, kind, hashes in hash_runs(stored, max(start - n, 0), max(stop - n, 0))
        ]
    keys = record[1][start:stop]
    if not keys:
        return []
    hashes = list(keys) if record[0] <= STORED else [hash_preimage(k) for k in keys]
    return [(start, MEDIUMS[record[0] >> 1], record[0] & 1 == STORED, hashes)]


class EventGap(CacheError):
    """The requested events fell out of the ring (maps to OUT_OF_RANGE)."""


class EventLog:
    """Numbers the block manager's event records and keeps the newest ``capacity`` events.

    Records stay as the block manager made them (one per commit, not one per block) until a
    watcher reads them: appending costs a few operations per RPC, and event objects are built
    only for events someone streams. Event ids are contiguous, one per block event.
    """

    def __init__(self, block_size: int, capacity: int = 65536):
        self.block_size = block_size
        self.capacity = capacity
        # Records oldest first and each one's first event id, side by side (no pair per record:
        # a kept tuple costs the garbage collector's young generation a pass, about 0.2 µs in
        # block_manager_ab); whole records are dropped, so between capacity and capacity + one
        # record's events are kept.
        self._records: deque[EventRecord] = deque()
        self._first_ids: deque[int] = deque()
        self._num_kept = 0
        self.last_event_id = 0
        self._changed = asyncio.Event()
        self.sinks: list[Callable[[list[EventRecord]], None]] = []
        """Called with each non-empty ``extend``'s records, after numbering (e.g. the ZMQ
        publisher of ``--kv-events-endpoint``). They run on the loop and must not block."""

    def extend(self, records: list[EventRecord]) -> None:
        """Number and keep `records` (from `BlockManager.take_event_records()`), then wake the watchers."""
        if not records:
            return
        kept, first_ids = self._records, self._first_ids
        kept += records
        next_id = self.last_event_id + 1
        for record in records:
            first_ids.append(next_id)
            next_id += len(record[1])  # num_events, inline: this runs on every RPC
        self._num_kept += next_id - 1 - self.last_event_id
        self.last_event_id = next_id - 1
        while self._num_kept - len(kept[0][1]) >= self.capacity:
            first_ids.popleft()
            self._num_kept -= len(kept.popleft()[1])
        # Waking resolves each waiter's future, so clearing right after does not un-wake them.
        self._changed.set()
        self._changed.clear()
        for sink in self.sinks:
            sink(records)

    def since(self, event_id: int, max_events: int | None = None) -> list[tuple[int, BlockEvent]]:
        """``(event id, event)`` for ids > `event_id` (0: every event kept), oldest first; at most
        `max_events` of them (the next ones, by default all).

        Only the events returned are built: a watcher reads the log in chunks from where it is,
        so a stream costs one chunk of events, not a copy of the history it has yet to send.
        Raises EventGap if some of them were already dropped.
        """

        def events(record: EventRecord, first: int, start: int, stop: int):
            return zip(itertools.count(first + start), decode_events(record, self.block_size, start, stop))

        return self._read(event_id, max_events, events)

    def runs_since(self, event_id: int, max_events: int | None = None) -> list[HashRun]:
        """``since``'s events as ``HashRun``s (``hash_runs``; their event ids the log's): a run of
        hashes per record read, no object per event."""

        def runs(record: EventRecord, first: int, start: int, stop: int):
            return [
                (first + at, medium, stored, hashes)
                for at, medium, stored, hashes in hash_runs(record, start, stop)
            ]

        return self._read(event_id, max_events, runs)

    def _read(self, event_id: int, max_events: int | None, read: Callable) -> list:
        """What ``read(record, its first event id, start, stop)`` makes of the events after
        `event_id` (at most `max_events`), record by record, concatenated."""
        if event_id >= self.last_event_id:
            return []
        oldest = self._first_ids[0]
        if event_id and event_id + 1 < oldest:
            raise EventGap(
                f"since_event_id {event_id} is older than the oldest kept event {oldest}: the events "
                f"between were dropped (the log keeps the newest {self.capacity}): resynchronize with "
                "LookupPrefix and watch from 0 (every kept event)"
            )
        left = self.last_event_id - event_id if max_events is None else max_events
        # The record holding event_id + 1: the last one that starts at or before it.
        at = max(bisect_right(self._first_ids, event_id + 1) - 1, 0)
        out: list = []
        starts = itertools.islice(self._first_ids, at, None)
        for first, record in zip(starts, itertools.islice(self._records, at, None), strict=True):
            skip = max(event_id + 1 - first, 0)
            take = min(num_events(record) - skip, left)
            out.extend(read(record, first, skip, skip + take))
            left -= take
            if left <= 0:
                break
        return out

    async def wait(self) -> None:
        """Return when new events arrive."""
        await self._changed.wait()
