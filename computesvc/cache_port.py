"""What the scheduler needs from the cache: the `BlockCache` port and its errors.

The scheduler talks to the cache only through this port: `computesvc.remote_cache.RemoteCache`
serves it over gRPC in a replica, `bench/separation.py` serves it in-process. Its item types are
`kvtier.sequence_types`' (the same values the cache service's domain takes) and its errors
`kvtier.cache_errors`' (what every client of the cache service raises), re-exported here as the
scheduler's vocabulary. Nothing here imports gRPC.
"""

from __future__ import annotations

from typing import Protocol

from kvtier.cache_errors import CacheUnavailable, ExceedsLimit, NoFreeBlocks, TenantLimited
from kvtier.sequence_types import AllocateItem, CommitItem, ExtendItem, ReleaseItem, SequenceBlocks

__all__ = [
    "AllocateItem",
    "BlockCache",
    "CacheUnavailable",
    "CommitItem",
    "ExceedsLimit",
    "ExtendItem",
    "NoFreeBlocks",
    "ReleaseItem",
    "SequenceBlocks",
    "TenantLimited",
]


class BlockCache(Protocol):
    """The calls the scheduler makes. Every method is batched and all-or-nothing.

    Extend, Free and SwapOut take `commits` too, applied first and all or nothing with the
    rest of the call, so a decode step reports what it wrote without a Commit of its own.
    Extend also takes `releases`: blocks a sliding window left behind (computesvc.window).
    Each raises NoFreeBlocks when the cache has no room and CacheUnavailable when it is gone.
    """

    block_size: int  # tokens per block
    max_model_len: int  # tokens a sequence may hold

    async def allocate(self, items: list[AllocateItem]) -> list[SequenceBlocks]: ...
    async def extend(
        self, items: list[ExtendItem], commits: list[CommitItem] = (), releases: list[ReleaseItem] = ()
    ) -> list[SequenceBlocks]: ...
    async def commit(self, items: list[CommitItem]) -> None: ...
    async def free(self, sequence_ids: list[int], commits: list[CommitItem] = ()) -> None: ...
    async def swap_out(
        self, sequence_ids: list[int], commits: list[CommitItem] = ()
    ) -> int: ...  # bytes moved
    async def swap_in(self, sequence_ids: list[int]) -> list[SequenceBlocks]: ...
