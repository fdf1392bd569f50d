"""What the scheduler needs from the cache: the `BlockCache` port and its errors.

The scheduler talks to the cache only through this port: `computesvc.remote_cache.RemoteCache`
serves it over gRPC in a replica, `bench/separation.py` serves it in-process. Its item types are
`kvtier.sequence_types`' (the same values the cache service's domain takes), re-exported here as
the scheduler's vocabulary. Nothing here imports gRPC.
"""

from __future__ import annotations

from typing import Protocol

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


class NoFreeBlocks(Exception):
    """The cache has no room for this call (RESOURCE_EXHAUSTED): preempt or wait."""


class ExceedsLimit(NoFreeBlocks):
    """The request can never fit (RESOURCE_EXHAUSTED with reason EXCEEDS_LIMIT): it alone needs
    more blocks than its tenant's quota, the per-lease limit or the whole pool. Fail it at once."""


class TenantLimited(NoFreeBlocks):
    """A tenant's own quota or fair share refused the room, not the pool (RESOURCE_EXHAUSTED with a
    QuotaFailure naming `tenant`): preempt that tenant's own sequences, freeing them (a quota
    counts the host tier's blocks too)."""

    def __init__(self, message: str, tenant: str):
        super().__init__(message)
        self.tenant = tenant


class CacheUnavailable(Exception):
    """The cache service cannot be reached (or restarted and forgot our lease): retryable."""


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
