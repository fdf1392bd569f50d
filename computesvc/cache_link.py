"""The scheduler's `BlockCache`, served by the remote cache service over gRPC.

This is the one place where compute turns cache-service status codes into the scheduler's
exceptions: RESOURCE_EXHAUSTED -> NoFreeBlocks (preempt or wait); UNAVAILABLE or an unknown
lease -> CacheUnavailable (the replica re-attaches); any other code -> RuntimeError naming it.
"""

from __future__ import annotations

import grpc

from computesvc.scheduler import CacheUnavailable, NoFreeBlocks, SeqBlocks
from kvtier.api import cache_pb2
from kvtier.cache_client import CacheClient


def _blocks(seqs) -> list[SeqBlocks]:
    return [SeqBlocks(s.sequence_id, list(s.block_table), s.num_cached_tokens) for s in seqs]


class RemoteCache:
    def __init__(self, client: CacheClient):
        if client.pool is None:
            raise ValueError("attach the client before wrapping it")
        self.client = client
        self.block_size = client.pool.block_size
        self.max_model_len = client.pool.max_model_len

    async def _rpc(self, call):
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise NoFreeBlocks(e.details()) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or (
                code == grpc.StatusCode.NOT_FOUND and e.details().startswith("lease")
            ):
                raise CacheUnavailable(f"cache service: {code.name}: {e.details()}") from None
            # Anything else is a bug on one side: say what the cache service refused, briefly.
            raise RuntimeError(f"cache service refused the call: {code.name}: {e.details()}") from None

    async def allocate(self, prompts, salts, lookahead) -> list[SeqBlocks]:
        items = [
            cache_pb2.AllocateItem(token_ids=p, cache_salt=s, num_lookahead_tokens=n)
            for p, s, n in zip(prompts, salts, lookahead, strict=True)
        ]
        return _blocks((await self._rpc(self.client.allocate_items(items))).sequences)

    async def extend(self, items) -> list[SeqBlocks]:
        return _blocks((await self._rpc(self.client.extend(items))).sequences)

    async def commit(self, items) -> None:
        await self._rpc(self.client.commit(items))

    async def free(self, sequence_ids) -> None:
        await self._rpc(self.client.free(sequence_ids))

    async def swap_out(self, sequence_ids) -> int:
        return (await self._rpc(self.client.swap_out(sequence_ids))).num_bytes

    async def swap_in(self, sequence_ids) -> list[SeqBlocks]:
        return _blocks((await self._rpc(self.client.swap_in(sequence_ids))).sequences)
