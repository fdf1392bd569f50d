"""gRPC servicer of the cache service: proto <-> domain, and domain errors -> status codes.

Each RPC is one call into the domain (`SequenceTable`, `LeaseTable`); no cache logic lives here.
Everything runs on the server's single asyncio loop, so domain calls never interleave and the
domain objects need no locks.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from cachesvc.errors import (
    CacheError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from cachesvc.events import EventGap, EventLog
from cachesvc.leases import LeaseTable
from cachesvc.sequences import AllocateSpec, SequenceTable, SequenceView
from kvtier.api import cache_pb2, cache_pb2_grpc
from kvtier.pool import PoolSpec
from kvtier.wire import pool_spec_to_proto

log = logging.getLogger("kvtier.cache")

STATUS = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    EventGap: grpc.StatusCode.OUT_OF_RANGE,
}


def rpc(method):
    """Map domain errors to status codes and forward new block events to watchers."""

    @functools.wraps(method)
    async def wrapper(self: CacheServicer, request, context):
        try:
            return await method(self, request, context)
        except CacheError as e:
            code = STATUS.get(type(e), grpc.StatusCode.INTERNAL)
            log.debug("%s -> %s: %s", method.__name__, code.name, e)
            await context.abort(code, str(e))
        finally:
            self.events.extend(self.sequences.block_manager.take_event_records())

    return wrapper


def _nonempty(field: str, values):
    if len(values) == 0:
        raise InvalidArgument(f"{field} is empty: a call carries at least one sequence")
    return values


def _add_blocks(sequences, views: list[SequenceView]) -> None:
    """Append one SequenceBlocks per view to a response's repeated ``sequences`` field.

    NOTE: ``add(**fields)`` builds each message in place; constructing SequenceBlocks objects
    and passing the list costs half again as much (64 sequences: ~80 vs ~120 µs here).
    """
    add = sequences.add
    for view in views:
        add(
            sequence_id=view.sequence_id,
            block_table=view.block_table,
            num_cached_tokens=view.num_cached_tokens,
            num_slots=view.num_slots,
        )


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, sequences: SequenceTable, leases: LeaseTable, pool_spec: PoolSpec):
        self.sequences = sequences
        self.leases = leases
        self.pool_spec = pool_spec
        self.events = EventLog(sequences.block_size)

    # ------------------------------------------------------------ leases

    @rpc
    async def Attach(self, request, context):
        expected = request.model_fingerprint
        if expected and expected != self.pool_spec.model_fingerprint:
            raise FailedPrecondition(
                f"model fingerprint {expected[:12]}… does not match the pool's "
                f"{self.pool_spec.model_fingerprint[:12]}…: start compute with the cache service's model"
            )
        lease = self.leases.open(request.client_name or context.peer())
        log.info("lease %s… opened by %s", lease.lease_id[:8], lease.client_name)
        return cache_pb2.AttachResponse(
            lease_id=lease.lease_id,
            lease_ttl_s=self.leases.ttl_s,
            pool=pool_spec_to_proto(self.pool_spec),
            max_batch=self.sequences.max_batch,
        )

    @rpc
    async def Heartbeat(self, request, context):
        lease = self.leases.renew(request.lease_id)
        return cache_pb2.HeartbeatResponse(lease_ttl_s=self.leases.expires_in(lease))

    def release_expired_leases(self) -> int:
        """Release the sequences of every expired lease; returns how many leases expired."""
        expired = self.leases.pop_expired()
        for lease in expired:
            released = self.sequences.free_lease(lease.lease_id)
            log.warning(
                "lease %s… of %s expired: released its sequences (%d blocks back to the free queue)",
                lease.lease_id[:8],
                lease.client_name,
                released,
            )
        self.events.extend(self.sequences.block_manager.take_event_records())
        return len(expired)

    async def reap_leases_forever(self) -> None:
        # NOTE: leases are also checked lazily on every call, so this only bounds how long a dead
        # client's blocks stay referenced: at most a quarter TTL past expiry.
        while True:
            await asyncio.sleep(self.leases.ttl_s / 4)
            self.release_expired_leases()

    # ------------------------------------------------------------ sequences

    @rpc
    async def Allocate(self, request, context):
        lease = self.leases.get(request.lease_id)
        specs = [
            AllocateSpec(
                token_ids=list(item.token_ids),
                cache_salt=item.cache_salt,
                adapter_id=item.adapter_id,
                num_lookahead_tokens=item.num_lookahead_tokens,
                request_id=item.request_id,
            )
            for item in _nonempty("items", request.items)
        ]
        views = self.sequences.allocate(lease.lease_id, specs)
        response = cache_pb2.AllocateResponse()
        _add_blocks(response.sequences, views)
        return response

    @rpc
    async def Extend(self, request, context):
        lease = self.leases.get(request.lease_id)
        views = self.sequences.extend(
            lease.lease_id, [(i.sequence_id, i.num_tokens) for i in _nonempty("items", request.items)]
        )
        response = cache_pb2.ExtendResponse()
        _add_blocks(response.sequences, views)
        return response

    @rpc
    async def Commit(self, request, context):
        lease = self.leases.get(request.lease_id)
        items = [
            (i.sequence_id, list(i.token_ids), i.num_computed_tokens)
            for i in _nonempty("items", request.items)
        ]
        return cache_pb2.CommitResponse(num_blocks_published=self.sequences.commit(lease.lease_id, items))

    @rpc
    async def Free(self, request, context):
        lease = self.leases.get(request.lease_id)
        released = self.sequences.free(lease.lease_id, list(_nonempty("sequence_ids", request.sequence_ids)))
        return cache_pb2.FreeResponse(num_blocks_released=released)

    @rpc
    async def LookupPrefix(self, request, context):
        items = [(list(i.token_ids), i.cache_salt, i.adapter_id) for i in _nonempty("items", request.items)]
        return cache_pb2.LookupPrefixResponse(num_cached_tokens=self.sequences.lookup_prefix(items))

    @rpc
    async def SwapOut(self, request, context):
        lease = self.leases.get(request.lease_id)
        num_blocks, num_bytes = self.sequences.swap_out(
            lease.lease_id, list(_nonempty("sequence_ids", request.sequence_ids))
        )
        return cache_pb2.SwapOutResponse(num_blocks=num_blocks, num_bytes=num_bytes)

    @rpc
    async def SwapIn(self, request, context):
        lease = self.leases.get(request.lease_id)
        views, num_blocks, num_bytes = self.sequences.swap_in(
            lease.lease_id, list(_nonempty("sequence_ids", request.sequence_ids))
        )
        response = cache_pb2.SwapInResponse(num_blocks=num_blocks, num_bytes=num_bytes)
        _add_blocks(response.sequences, views)
        return response

    # ------------------------------------------------------------ observation

    @rpc
    async def GetStats(self, request, context):
        return self.stats()

    def stats(self) -> cache_pb2.GetStatsResponse:
        seqs = self.sequences
        bm = seqs.block_manager
        host = seqs.host_tier
        leases = []
        num_tokens = num_token_slots = 0
        for lease in self.leases:
            own = seqs.sequences_of(lease.lease_id)
            on_device = [s for s in own if s.location == "device"]
            lease_blocks = sum(len(s.block_table) for s in on_device)
            lease_tokens = sum(len(s.token_ids) for s in on_device)
            num_tokens += lease_tokens
            num_token_slots += lease_blocks * bm.block_size
            leases.append(
                cache_pb2.LeaseStats(
                    lease_id=lease.lease_id[:8],
                    client_name=lease.client_name,
                    num_sequences=len(own),
                    num_blocks=lease_blocks,
                    num_host_blocks=sum(len(s.host_slots) for s in own if s.location == "host"),
                    expires_in_s=self.leases.expires_in(lease),
                    num_tokens=lease_tokens,
                )
            )
        return cache_pb2.GetStatsResponse(
            num_blocks_total=bm.num_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_cached=bm.num_cached_blocks,
            usage_percent=100.0 * bm.num_used_blocks / bm.num_blocks,
            prefix_query_tokens=seqs.stats.prefix_query_tokens,
            prefix_hit_tokens=seqs.stats.prefix_hit_tokens,
            num_evictions=bm.num_evictions,
            num_host_blocks_total=host.num_blocks if host else 0,
            num_host_blocks_used=host.num_used_blocks if host else 0,
            num_swap_out_blocks=seqs.stats.num_swap_out_blocks,
            num_swap_in_blocks=seqs.stats.num_swap_in_blocks,
            num_swap_out_bytes=seqs.stats.num_swap_out_bytes,
            num_swap_in_bytes=seqs.stats.num_swap_in_bytes,
            num_sequences=len(seqs),
            num_swapped_sequences=seqs.num_swapped_sequences,
            leases=leases,
            block_size=bm.block_size,
            num_expired_leases=self.leases.num_expired,
            num_tokens=num_tokens,
            num_token_slots=num_token_slots,
        )

    async def WatchEvents(self, request, context):
        next_id = request.since_event_id
        while True:
            try:
                batch = self.events.since(next_id)
            except EventGap as e:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
            for event in batch:
                yield event
                next_id = event.event_id
            # Events that arrived while the batch was being sent are not waited for. Nothing else
            # runs on the loop between this check and wait() registering, so none slips through.
            if self.events.last_event_id <= next_id:
                await self.events.wait()
