"""The scheduler's `BlockCache`, served by the remote cache service over gRPC.

`kvtier.cache_client.CacheClient` does the wire: it returns the port's values and raises the
port's exceptions (RESOURCE_EXHAUSTED -> NoFreeBlocks, preempt or wait; UNAVAILABLE,
DEADLINE_EXCEEDED or an expired lease -> CacheUnavailable, the replica re-attaches;
INVALID_ARGUMENT -> InvalidRequest, a ValueError: the scheduler retries a batched Allocate item by
item and fails only the refused requests; see `kvtier.cache_errors`). This adds what the replica
needs beside: every answered call renews the lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.cache_client import CacheClient
from kvtier.computesvc.cache_port import AllocateItem, CommitItem, ExtendItem, ReleaseItem, SequenceBlocks


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
        reply = await call
        self.on_renewed(sent_at)
        return reply

    async def allocate(self, items: list[AllocateItem]) -> list[SequenceBlocks]:
        return await self._rpc(self.client.allocate(items))

    async def extend(
        self, items: list[ExtendItem], commits: list[CommitItem] = (), releases: list[ReleaseItem] = ()
    ) -> list[SequenceBlocks]:
        return await self._rpc(self.client.extend(items, commits, releases))

    async def commit(self, items: list[CommitItem]) -> None:
        await self._rpc(self.client.commit(items))

    async def free(self, sequence_ids: list[int], commits: list[CommitItem] = ()) -> None:
        await self._rpc(self.client.free(sequence_ids, commits))

    async def swap_out(self, sequence_ids: list[int], commits: list[CommitItem] = ()) -> int:
        return (await self._rpc(self.client.swap_out(sequence_ids, commits))).num_bytes

    async def swap_in(self, sequence_ids: list[int]) -> list[SequenceBlocks]:
        return (await self._rpc(self.client.swap_in(sequence_ids))).sequences
