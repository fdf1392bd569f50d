"""The scheduler's `BlockCache`, served by the remote cache service over gRPC.

This is the one place where compute turns cache-service status codes into the port's
exceptions: RESOURCE_EXHAUSTED -> NoFreeBlocks (preempt or wait); UNAVAILABLE, DEADLINE_EXCEEDED
or NOT_FOUND with reason LEASE_EXPIRED -> CacheUnavailable (the replica re-attaches);
INVALID_ARGUMENT -> ValueError (the scheduler retries a batched Allocate item by item and fails
only the refused requests); any other code -> RuntimeError naming it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from kvtier import status
from kvtier.cache_client import CacheClient, sequence_blocks
from kvtier.computesvc.cache_port import (
    AllocateItem,
    CacheUnavailable,
    CommitItem,
    ExceedsLimit,
    ExtendItem,
    NoFreeBlocks,
    ReleaseItem,
    SequenceBlocks,
    TenantLimited,
)


class RemoteCache:
    def __init__(self, client: CacheClient, on_renewed: Callable[[float], None] = lambda sent_at: None):
        """`on_renewed(sent_at)` hears of every successful call: the service renews the lease on
        each one, so a busy replica's lease stays alive even when a heartbeat is late."""
        if client.pool is None:
            raise ValueError("attach the client before wrapping it")
        self.client = client
        self.on_renewed = on_renewed
        self.block_size = client.pool.block_size
        self.max_model_len = client.pool.max_model_len

    async def _rpc(self, call):
        # NOTE: taken microseconds after the call was started; the quarter-TTL margin of the
        # replica's write deadline dwarfs that.
        sent_at = time.monotonic()
        try:
            reply = await call
            self.on_renewed(sent_at)
            return reply
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                if status.reason_of(e) == status.EXCEEDS_LIMIT:
                    raise ExceedsLimit(e.details()) from None
                if (tenant := status.quota_tenant_of(e)) is not None:
                    raise TenantLimited(e.details(), tenant) from None
                raise NoFreeBlocks(e.details()) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or (
                code == grpc.StatusCode.NOT_FOUND and status.reason_of(e) == status.LEASE_EXPIRED
            ):
                raise CacheUnavailable(f"cache service: {code.name}: {e.details()}") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"cache service refused the call: {code.name}: {e.details()}") from None
            # Anything else is a bug on one side: say what the cache service refused, briefly.
            raise RuntimeError(f"cache service refused the call: {code.name}: {e.details()}") from None

    async def allocate(self, items: list[AllocateItem]) -> list[SequenceBlocks]:
        return sequence_blocks((await self._rpc(self.client.allocate(items))).sequences)

    async def extend(
        self, items: list[ExtendItem], commits: list[CommitItem] = (), releases: list[ReleaseItem] = ()
    ) -> list[SequenceBlocks]:
        return sequence_blocks((await self._rpc(self.client.extend(items, commits, releases))).sequences)

    async def commit(self, items: list[CommitItem]) -> None:
        await self._rpc(self.client.commit(items))

    async def free(self, sequence_ids: list[int], commits: list[CommitItem] = ()) -> None:
        await self._rpc(self.client.free(sequence_ids, commits))

    async def swap_out(self, sequence_ids: list[int], commits: list[CommitItem] = ()) -> int:
        return (await self._rpc(self.client.swap_out(sequence_ids, commits))).num_bytes

    async def swap_in(self, sequence_ids: list[int]) -> list[SequenceBlocks]:
        return sequence_blocks((await self._rpc(self.client.swap_in(sequence_ids))).sequences)
