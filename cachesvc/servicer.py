"""gRPC servicer of the cache service: proto <-> domain, and domain errors -> status codes.

Each RPC converts its request, makes one call on the ``CacheNode`` and converts the result
back; no cache logic lives here. Everything runs on the server's single asyncio loop, so domain
calls never interleave and the domain objects need no locks.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, fields

import grpc

from kvtier import status
from kvtier.api import cache_pb2, cache_pb2_grpc
from kvtier.block_hash import hash_preimage
from kvtier.cachesvc.errors import (
    CacheError,
    ExceedsLimit,
    FailedPrecondition,
    InvalidArgument,
    LeaseExpired,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TenantLimit,
)
from kvtier.cachesvc.events import BlockEvent, BlockRemoved, EventGap, EventLog
from kvtier.cachesvc.node import CacheNode, CacheSnapshot
from kvtier.cachesvc.validation import (
    MAX_LEASE_ID_BYTES,
    MAX_NAME_BYTES,
    check_batch,
    check_item_sizes,
    check_text,
)
from kvtier.media import LOWER_MEDIA
from kvtier.pool import PoolSpec
from kvtier.sequence_types import (
    AllocateItem,
    CommitItem,
    ExtendItem,
    PrefixQuery,
    ReleaseItem,
    SequenceBlocks,
)
from kvtier.wire import pool_spec_to_proto

log = logging.getLogger("kvtier.cache")

STATUS = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    LeaseExpired: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ExceedsLimit: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TenantLimit: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    EventGap: grpc.StatusCode.OUT_OF_RANGE,
}
# Errors a caller must tell apart from others of the same code: an ErrorInfo reason rides along.
REASON = {LeaseExpired: status.LEASE_EXPIRED, ExceedsLimit: status.EXCEEDS_LIMIT}


def rpc(method):
    """Map domain errors to status codes (with an ErrorInfo reason where one is defined).

    NOTE: the abort is raised outside the ``except`` block and after dropping ``request``: the
    abort's traceback holds this frame, and chaining it to the domain error would hold the
    frames that built lists from the request, for as long as grpc keeps the abort.
    """

    @functools.wraps(method)
    async def wrapper(self: CacheServicer, request, context):
        handling, request = method(self, request, context), None
        try:
            return await handling
        except CacheError as e:
            code = STATUS.get(type(e), grpc.StatusCode.INTERNAL)
            details = str(e)
            log.debug("%s -> %s: %s", method.__name__, code.name, details)
            reason = REASON.get(type(e), "")
            quota_tenant = e.tenant if isinstance(e, TenantLimit) else None  # a QuotaFailure names it
        handling = None
        limited = reason or quota_tenant is not None
        trailer = status.details_trailer(code, details, reason, quota_tenant) if limited else ()
        await context.abort(code, details, trailing_metadata=trailer)

    return wrapper


def _lease_id(request) -> str:
    """The request's lease id, bounded (a lease id is 32 hex digits)."""
    check_text("lease_id", request.lease_id, MAX_LEASE_ID_BYTES)
    return request.lease_id


# Events an event stream builds at a time from the log (WatchEventBatches: at most this many a message).
WATCH_CHUNK = 256
HELD_CHUNK = 4096  # block hashes a held message carries at most (~150 KB)


def held_batches(as_of: int, media: list[tuple[str, list[bytes]]], events: EventLog):
    """WatchEventBatches' held messages: the hashes of the index keys ``media`` holds (medium,
    keys; ``CacheNode.held_blocks``) as of event ``as_of``, HELD_CHUNK a message, hashed as each
    message is built (the loop serves other calls between them); the last has ``held_end``, and
    ``caught_up`` when no event came after ``as_of`` meanwhile. At least one message, even for none."""
    pieces = [(m, keys[i : i + HELD_CHUNK]) for m, keys in media for i in range(0, len(keys), HELD_CHUNK)]
    for n, (medium, keys) in enumerate(pieces or [("", [])]):
        batch = cache_pb2.WatchEventBatchesResponse(held_as_of_event_id=as_of)
        if keys:
            batch.held.add(medium=medium, block_hashes=[hash_preimage(k) for k in keys])
        if n == len(pieces) - 1 or not pieces:
            batch.held_end = True
            batch.caught_up = events.last_event_id <= as_of
        yield batch


def _add_blocks(sequences, blocks: list[SequenceBlocks]) -> None:
    """Append one SequenceBlocks message per domain SequenceBlocks to a response's ``sequences``.

    NOTE: ``add(**fields)`` builds each message in place; constructing SequenceBlocks messages
    and passing the list costs half again as much (64 sequences: ~80 vs ~120 µs here).
    """
    add = sequences.add
    for b in blocks:
        add(
            sequence_id=b.sequence_id,
            block_table=b.block_table,
            num_cached_tokens=b.num_cached_tokens,
            num_slots=b.num_slots,
        )


def stats_to_proto(snapshot: CacheSnapshot) -> cache_pb2.GetStatsResponse:
    """GetStatsResponse of a snapshot. NOTE: the snapshot's field names are the message's."""
    leases = [cache_pb2.LeaseStats(**asdict(lease)) for lease in snapshot.leases]
    tenants = [cache_pb2.TenantStats(**asdict(t)) for t in snapshot.tenants]
    tiers = [cache_pb2.TierStats(**asdict(t)) for t in snapshot.tiers]
    lists = ("leases", "tenants", "tiers")
    scalars = {f.name: getattr(snapshot, f.name) for f in fields(snapshot) if f.name not in lists}
    return cache_pb2.GetStatsResponse(**scalars, leases=leases, tenants=tenants, tiers=tiers)


def event_to_proto(
    event_id: int, event: BlockEvent, with_token_ids: bool = True, into: cache_pb2.CacheEvent | None = None
) -> cache_pb2.CacheEvent:
    """The CacheEvent message of one numbered event from ``EventLog.since``, built in ``into`` when
    given (a batch's ``events.add()``: no message built and then copied into the batch)."""
    message = cache_pb2.CacheEvent() if into is None else into
    message.event_id = event_id
    if isinstance(event, BlockRemoved):
        removed = message.block_removed
        removed.SetInParent()  # the oneof is set even when every field holds its default
        removed.block_hash, removed.block_id, removed.medium = event.block_hash, event.block_id, event.medium
        return message
    stored = message.block_stored
    stored.SetInParent()
    stored.block_hash = event.block_hash
    stored.parent_block_hash = event.parent_block_hash or b""
    stored.block_id = event.block_id
    if with_token_ids:
        stored.token_ids.extend(event.token_ids)
    stored.medium = event.medium
    return message


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    """The CacheService RPCs. Repeated fields are bounded (items per call, tokens per item,
    string sizes) on the wire message before any Python list is built from them.

    `max_watch_streams`: most WatchEvents streams open at once; one more is RESOURCE_EXHAUSTED.
    """

    def __init__(self, node: CacheNode, pool_spec: PoolSpec, max_watch_streams: int = 64):
        self.node = node
        self.pool_spec = pool_spec
        self.max_batch = node.sequences.max_batch
        self.max_model_len = node.sequences.max_model_len
        self.max_watch_streams = max_watch_streams
        self.num_watch_streams = 0

    # ------------------------------------------------------------ leases

    @rpc
    async def Attach(self, request, context):
        check_text("client_name", request.client_name, MAX_NAME_BYTES)
        check_text("model_fingerprint", request.model_fingerprint, MAX_NAME_BYTES)
        check_text("previous_lease_id", request.previous_lease_id, MAX_NAME_BYTES)
        lease = self.node.attach(
            request.client_name or context.peer(), request.model_fingerprint, request.previous_lease_id
        )
        return cache_pb2.AttachResponse(
            lease_id=lease.lease_id,
            lease_ttl_s=self.node.leases.ttl_s,
            pool=pool_spec_to_proto(self.pool_spec),
            max_batch=self.node.sequences.max_batch,
        )

    def _live_lease(self, request) -> str:
        """The request's lease id, checked before its items as the domain checks them (an unknown
        lease is NOT_FOUND whatever the items), so bounding the items first changes no answer."""
        lease_id = _lease_id(request)
        self.node.leases.get(lease_id)
        return lease_id

    @rpc
    async def Heartbeat(self, request, context):
        return cache_pb2.HeartbeatResponse(lease_ttl_s=self.node.heartbeat(_lease_id(request)))

    # ------------------------------------------------------------ sequences

    @rpc
    async def Allocate(self, request, context):
        lease_id = self._live_lease(request)
        check_batch(len(request.items), self.max_batch)
        items = []
        for k, item in enumerate(request.items):
            tokens = item.token_ids
            check_item_sizes(
                k, len(tokens), self.max_model_len, item.tenant_salt, item.adapter_id, item.request_id
            )
            if len(item.tenant) > MAX_NAME_BYTES // 4:
                check_text(f"items[{k}].tenant", item.tenant, MAX_NAME_BYTES)
            items.append(
                AllocateItem(
                    token_ids=list(tokens),
                    tenant_salt=item.tenant_salt,
                    adapter_id=item.adapter_id,
                    num_lookahead_tokens=item.num_lookahead_tokens,
                    request_id=item.request_id,
                    tenant=item.tenant,
                )
            )
        response = cache_pb2.AllocateResponse()
        _add_blocks(response.sequences, self.node.allocate(lease_id, items))
        return response

    @rpc
    async def Extend(self, request, context):
        lease_id, commits = self._carried_commits(request)
        # NOTE: plain tuples in ExtendItem / CommitItem field order (the domain unpacks them): a
        # NamedTuple costs ~150 ns more per item, and Extend and Commit run every decode step.
        items: list[ExtendItem] = [(i.sequence_id, i.num_tokens) for i in request.items]
        # A sliding window's releases: rare (once per block a window passes), so typed.
        check_batch(len(request.releases), self.max_batch, "releases")  # before building a list
        releases = [ReleaseItem(i.sequence_id, i.num_blocks) for i in request.releases]
        response = cache_pb2.ExtendResponse()
        _add_blocks(response.sequences, self.node.extend(lease_id, items, commits, releases))
        return response

    @rpc
    async def Commit(self, request, context):
        lease_id = self._live_lease(request)
        items = self._commit_items(request.items)
        return cache_pb2.CommitResponse(num_blocks_published=self.node.commit(lease_id, items))

    def _carried_commits(self, request) -> tuple[str, list[CommitItem]]:
        """The lease id and the commits an Extend, Free or SwapOut request carries (the lease is
        checked first when there are commits, as Commit checks it before bounding its items)."""
        if not request.commits:
            return _lease_id(request), []
        return self._live_lease(request), self._commit_items(request.commits)

    def _commit_items(self, messages) -> list[CommitItem]:
        """CommitItem messages (of Commit, or carried by Extend / Free / SwapOut), bounded first."""
        check_batch(len(messages), self.max_batch)
        max_len = self.max_model_len
        items = []
        for k, i in enumerate(messages):
            if len(i.token_ids) > max_len:
                check_item_sizes(k, len(i.token_ids), max_len, "", "")
            items.append((i.sequence_id, list(i.token_ids), i.num_computed_tokens))  # see Extend
        return items

    @rpc
    async def Free(self, request, context):
        lease_id, commits = self._carried_commits(request)
        released = self.node.free(lease_id, list(request.sequence_ids), commits)
        return cache_pb2.FreeResponse(num_blocks_released=released)

    @rpc
    async def LookupPrefix(self, request, context):
        check_batch(len(request.items), self.max_batch)
        items = []
        for k, i in enumerate(request.items):
            check_item_sizes(k, len(i.token_ids), self.max_model_len, i.tenant_salt, i.adapter_id)
            items.append(PrefixQuery(list(i.token_ids), i.tenant_salt, i.adapter_id))
        below: list[tuple[int, ...]] = []  # per item: tokens per lower medium (LOWER_MEDIA order)
        device = self.node.lookup_prefix(items, below)
        media = [m.name for m in LOWER_MEDIA] if below else []
        per_medium = {name: [tokens[k] for tokens in below] for k, name in enumerate(media)}
        return cache_pb2.LookupPrefixResponse(
            num_cached_tokens=device,
            num_host_tokens=per_medium.get("host", []),
            num_disk_tokens=per_medium.get("disk", []),
            below=[cache_pb2.MediumTokens(medium=m, num_tokens=t) for m, t in per_medium.items()],
        )

    @rpc
    async def SwapOut(self, request, context):
        lease_id, commits = self._carried_commits(request)
        num_blocks, num_bytes = self.node.swap_out(lease_id, list(request.sequence_ids), commits)
        return cache_pb2.SwapOutResponse(num_blocks=num_blocks, num_bytes=num_bytes)

    @rpc
    async def SwapIn(self, request, context):
        lease_id = _lease_id(request)
        blocks, num_blocks, num_bytes = self.node.swap_in(lease_id, list(request.sequence_ids))
        response = cache_pb2.SwapInResponse(num_blocks=num_blocks, num_bytes=num_bytes)
        _add_blocks(response.sequences, blocks)
        return response

    # ------------------------------------------------------------ observation

    @rpc
    async def GetStats(self, request, context):
        reply = stats_to_proto(self.node.snapshot())
        reply.kv_cache_dtype, reply.block_bytes = self.pool_spec.dtype, self.pool_spec.block_bytes
        return reply

    async def WatchEvents(self, request, context):
        """Events after ``since_event_id``, one message each (``_event_chunks``)."""
        async for chunk, _ in self._event_chunks(request.since_event_id, context):
            for event_id, event in chunk:
                yield event_to_proto(event_id, event)

    async def WatchEventBatches(self, request, context):
        """WatchEvents' events, one message per chunk the log gives (``_event_chunks``): all the
        events that are ready when it is sent, up to WATCH_CHUNK; without token ids if asked.
        ``start_with_held``: first the blocks held now (``held_batches``), then the events after;
        ``hashes_only``: the events as runs of hashes (``EventLog.runs_since``), no message per event."""
        omit, held, runs = request.omit_token_ids, request.start_with_held, request.hashes_only
        if held and request.since_event_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"start_with_held begins with the blocks held now: since_event_id must be 0, not "
                f"{request.since_event_id} (or leave start_with_held false to resume after an event)",
            )
        async for chunk, caught_up in self._event_chunks(request.since_event_id, context, held, runs):
            if isinstance(chunk, cache_pb2.WatchEventBatchesResponse):
                yield chunk  # a held message
                continue
            batch = cache_pb2.WatchEventBatchesResponse(caught_up=caught_up)
            if runs:
                add_run = batch.runs.add
                for first, medium, stored, hashes in chunk:
                    add_run(first_event_id=first, medium=medium, stored=stored, block_hashes=hashes)
            else:
                add = batch.events.add
                for event_id, event in chunk:
                    event_to_proto(event_id, event, not omit, add())
            yield batch

    async def _event_chunks(
        self, since_event_id: int, context, start_with_held: bool = False, runs: bool = False
    ):  # fmt: skip
        """Chunks of the events after ``since_event_id``, read from the shared log as they come,
        each with whether it ends at the newest event (``caught_up``); with ``start_with_held``,
        first the held messages (``held_batches``) and then the events after them. A chunk is a
        list of ``(event id, event)``, or with ``runs`` of ``HashRun``s (``EventLog.runs_since``).

        A stream holds one chunk of events (WATCH_CHUNK), never its backlog: that stays in the
        log, which keeps the newest events for every stream. A reader that falls behind the log
        is ended with OUT_OF_RANGE (resynchronize, watch from 0).
        """
        if self.num_watch_streams >= self.max_watch_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.num_watch_streams} event streams are open, the most this service "
                f"allows (--max-watch-streams {self.max_watch_streams}): close one, or retry later",
            )
        self.num_watch_streams += 1
        try:
            events = self.node.events
            next_id = since_event_id
            if start_with_held:  # taken in this loop turn: no event slips between them and next_id
                next_id, media = self.node.held_blocks()
                for batch in held_batches(next_id, media, events):
                    yield batch, batch.caught_up
            while True:
                try:
                    chunk = (events.runs_since if runs else events.since)(next_id, WATCH_CHUNK)
                except EventGap as e:
                    await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
                if chunk:
                    next_id = chunk[-1][0] + (len(chunk[-1][3]) - 1 if runs else 0)
                    yield chunk, events.last_event_id <= next_id
                # Events that arrived while the chunk was being sent are not waited for. Nothing
                # else runs on the loop between this check and wait() registering, so none slips
                # through.
                if events.last_event_id <= next_id:
                    await events.wait()
        finally:
            self.num_watch_streams -= 1
