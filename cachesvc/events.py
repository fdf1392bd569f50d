"""A bounded, numbered log of BlockStored / BlockRemoved events for `WatchEvents` streams."""

from __future__ import annotations

import asyncio
from collections import deque

from cachesvc.block_manager import BlockRemoved, EventRecord, decode_events, num_events
from cachesvc.errors import CacheError
from kvtier.api import cache_pb2


class EventGap(CacheError):
    """The requested events fell out of the ring (maps to OUT_OF_RANGE)."""


class EventLog:
    """Numbers the block manager's event records and keeps the newest ``capacity`` events.

    Records stay as the block manager made them (one per commit, not one per block) until a
    watcher reads them: appending costs a few operations per RPC, and protobuf messages are built
    only for events someone streams. Event ids are contiguous, one per block event.
    """

    def __init__(self, block_size: int, capacity: int = 65536):
        self.block_size = block_size
        self.capacity = capacity
        # (first event id, record), oldest first; whole records are dropped, so between
        # capacity and capacity + one record's events are kept.
        self._ring: deque[tuple[int, EventRecord]] = deque()
        self._num_kept = 0
        self.last_event_id = 0
        self._changed = asyncio.Event()

    def extend(self, records: list[EventRecord]) -> None:
        """Number and keep `records` (from `BlockManager.take_event_records()`), then wake the watchers."""
        if not records:
            return
        ring = self._ring
        next_id = self.last_event_id + 1
        for record in records:
            ring.append((next_id, record))
            next_id += len(record[1])  # num_events, inline: this runs on every RPC
        self._num_kept += next_id - 1 - self.last_event_id
        self.last_event_id = next_id - 1
        while self._num_kept - num_events(ring[0][1]) >= self.capacity:
            self._num_kept -= num_events(ring.popleft()[1])
        # Waking resolves each waiter's future, so clearing right after does not un-wake them.
        self._changed.set()
        self._changed.clear()

    def since(self, event_id: int) -> list[cache_pb2.CacheEvent]:
        """Events with id > `event_id` (0: every event kept); EventGap if some were already dropped."""
        if event_id >= self.last_event_id:
            return []
        oldest = self._ring[0][0]
        if event_id and event_id + 1 < oldest:
            raise EventGap(
                f"since_event_id {event_id} is older than the oldest kept event {oldest}: "
                "resynchronize with LookupPrefix and watch from 0"
            )
        # Walk back from the newest record to the one holding event_id + 1.
        picked: list[tuple[int, EventRecord]] = []
        for first, record in reversed(self._ring):
            picked.append((first, record))
            if first <= event_id + 1:
                break
        out: list[cache_pb2.CacheEvent] = []
        for first, record in reversed(picked):
            for k, event in enumerate(decode_events(record, self.block_size)):
                if first + k > event_id:
                    out.append(self._message(first + k, event))
        return out

    @staticmethod
    def _message(event_id: int, event) -> cache_pb2.CacheEvent:
        if isinstance(event, BlockRemoved):
            removed = cache_pb2.BlockRemoved(block_hash=event.block_hash, block_id=event.block_id)
            return cache_pb2.CacheEvent(event_id=event_id, block_removed=removed)
        stored = cache_pb2.BlockStored(
            block_hash=event.block_hash,
            parent_block_hash=event.parent_block_hash or b"",
            block_id=event.block_id,
            token_ids=event.token_ids,
        )
        return cache_pb2.CacheEvent(event_id=event_id, block_stored=stored)

    async def wait(self) -> None:
        """Return when new events arrive."""
        await self._changed.wait()
