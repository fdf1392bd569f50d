"""A bounded, numbered log of BlockStored / BlockRemoved events for `WatchEvents` streams."""

from __future__ import annotations

import asyncio
from collections import deque

from cachesvc.block_manager import BlockRemoved, BlockStored
from cachesvc.errors import CacheError
from kvtier.api import cache_pb2


class EventGap(CacheError):
    """The requested events fell out of the ring (maps to OUT_OF_RANGE)."""


class EventLog:
    def __init__(self, capacity: int = 65536):
        self._ring: deque[cache_pb2.CacheEvent] = deque(maxlen=capacity)
        self.last_event_id = 0
        self._changed = asyncio.Event()

    def extend(self, events: list[BlockStored | BlockRemoved]) -> None:
        """Number and keep `events` (from `BlockManager.take_events()`), then wake the watchers."""
        for event in events:
            self.last_event_id += 1
            if isinstance(event, BlockStored):
                msg = cache_pb2.CacheEvent(
                    event_id=self.last_event_id,
                    block_stored=cache_pb2.BlockStored(
                        block_hash=event.block_hash,
                        parent_block_hash=event.parent_block_hash or b"",
                        block_id=event.block_id,
                        token_ids=event.token_ids,
                    ),
                )
            else:
                msg = cache_pb2.CacheEvent(
                    event_id=self.last_event_id,
                    block_removed=cache_pb2.BlockRemoved(
                        block_hash=event.block_hash, block_id=event.block_id
                    ),
                )
            self._ring.append(msg)
        if events:
            self._changed.set()
            self._changed = asyncio.Event()

    def since(self, event_id: int) -> list[cache_pb2.CacheEvent]:
        """Events with id > `event_id` (0: every event kept); EventGap if some were already dropped."""
        if event_id > self.last_event_id:
            return []
        oldest = self._ring[0].event_id if self._ring else self.last_event_id + 1
        if event_id and event_id + 1 < oldest:
            raise EventGap(
                f"since_event_id {event_id} is older than the oldest kept event {oldest}: "
                "resynchronize with LookupPrefix and watch from 0"
            )
        skip = max(0, event_id + 1 - oldest)
        return [self._ring[i] for i in range(skip, len(self._ring))]

    async def wait(self) -> None:
        """Return when new events arrive."""
        await self._changed.wait()
