"""The cache service's server streams as iterators (``WatchEvents``, ``WatchEventBatches``), and
the one mapping of a failed call's gRPC status to ``kvtier.cache_errors`` (``call_error``),
which ``kvtier.cache_client.CacheClient``'s unary calls raise too."""

from __future__ import annotations

import grpc

from kvtier import status
from kvtier.cache_errors import (
    CacheCallError,
    CacheUnavailable,
    ExceedsLimit,
    InvalidRequest,
    NoFreeBlocks,
    TenantLimited,
)
from kvtier.sequence_types import BlockStored, CacheEvent, EventBatch, HashRun, HeldBatch, RunBatch
from kvtier.wire import event_from_proto

RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # with an expired lease: CacheUnavailable


def call_error(e: grpc.RpcError) -> CacheCallError:
    """The exception of `kvtier.cache_errors` for a failed call (the one place status codes are read)."""
    code, details = e.code().name, e.details() or ""
    if code == "RESOURCE_EXHAUSTED":
        if status.reason_of(e) == status.EXCEEDS_LIMIT:
            return ExceedsLimit(details, code, status.EXCEEDS_LIMIT)
        if (tenant := status.quota_tenant_of(e)) is not None:
            return TenantLimited(details, tenant, code)
        return NoFreeBlocks(details, code)
    reason = status.reason_of(e)
    if code in RETRYABLE or (code == "NOT_FOUND" and reason == status.LEASE_EXPIRED):
        return CacheUnavailable(f"cache service: {code}: {details}", code, reason, details)
    kind = InvalidRequest if code == "INVALID_ARGUMENT" else CacheCallError
    return kind(f"cache service refused the call: {code}: {details}", code, reason, details)


class EventStream:
    """A WatchEvents stream of CacheEvents: ``for`` / ``next()`` it on a sync channel, ``async for``
    on an aio one; ``cancel()`` ends it. A stream that fails raises `call_error`'s exception
    (code OUT_OF_RANGE: the service dropped events this reader had not read; watch from 0)."""

    def __init__(self, call):
        self.call = call

    def cancel(self) -> bool:
        return self.call.cancel()

    def _value(self, message):
        """The value of one message (None: nothing this client knows; read the next)."""
        return event_from_proto(message)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            while (value := self._value(next(self.call))) is None:
                pass  # a kind of event this client does not know
        except grpc.RpcError as e:
            raise call_error(e) from None
        return value

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    raise StopAsyncIteration
                if (value := self._value(message)) is not None:
                    return value
        except grpc.RpcError as e:
            raise call_error(e) from None


class EventBatchStream(EventStream):
    """A WatchEventBatches stream: each item an ``EventBatch``, its events oldest first, and
    whether the last was the service's newest event when it was sent (``caught_up``); asked
    ``start_with_held``, ``HeldBatch``es first; asked ``hashes_only``, ``RunBatch``es (from a
    cache that sends events anyway, an older one, its events grouped into runs here)."""

    def __init__(self, call, hashes_only: bool = False):
        super().__init__(call)
        self.hashes_only = hashes_only

    def _value(self, message):
        if message.held or message.held_end:  # a held message (each has hashes, or is the end): no events
            held = [(h.medium, list(h.block_hashes)) for h in message.held]  # BlockHash is bytes
            return HeldBatch(held, message.held_as_of_event_id, message.held_end, message.caught_up)
        if self.hashes_only and not message.events:
            runs = [HashRun(r.first_event_id, r.medium or "device", r.stored, list(r.block_hashes))
                    for r in message.runs]  # fmt: skip
            return RunBatch(runs, message.caught_up) if runs or message.caught_up else None
        events = [e for e in map(event_from_proto, message.events) if e is not None]
        if self.hashes_only:
            return RunBatch(runs_of(events), message.caught_up) if events or message.caught_up else None
        return EventBatch(events, message.caught_up) if events or message.caught_up else None


def runs_of(events: list[CacheEvent]) -> list[HashRun]:
    """Numbered events as ``HashRun``s: consecutive events of one medium and kind in one run."""
    runs: list[HashRun] = []
    for event_id, event in events:
        stored = isinstance(event, BlockStored)
        last = runs[-1] if runs else None
        if last is not None and (last.medium, last.stored, last.last_event_id + 1) == (
            event.medium,
            stored,
            event_id,
        ):
            last.hashes.append(event.block_hash)
        else:
            runs.append(HashRun(event_id, event.medium, stored, [event.block_hash]))
    return runs
