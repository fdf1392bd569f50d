"""What the scheduler needs from the cache: the `BlockCache` port, its item types and its errors.

The scheduler talks to the cache only through this port: `computesvc.remote_cache.RemoteCache`
serves it over gRPC in a replica, `bench/separation.py` serves it in-process. Nothing here
imports gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol


class NoFreeBlocks(Exception):
    """The cache has no room for this call (RESOURCE_EXHAUSTED): preempt or wait."""


class ExceedsLimit(NoFreeBlocks):
    """The request can never fit (RESOURCE_EXHAUSTED with reason EXCEEDS_LIMIT): it alone needs
    more blocks than its tenant's quota, the per-lease limit or the whole pool. Fail it at once."""


class CacheUnavailable(Exception):
    """The cache service cannot be reached (or restarted and forgot our lease): retryable."""


@dataclass(slots=True)
class SequenceBlocks:
    """A sequence's blocks, as Allocate / Extend / SwapIn return them."""

    sequence_id: int
    block_table: list[int]  # pool block ids in token order
    num_cached_tokens: int = 0  # leading prompt tokens served from the prefix cache at Allocate


# NOTE: the items are tuples so that the cache client (and the cache domain's SequenceTable),
# which take (sequence_id, ...) tuples, consume them as they are: Extend and Commit run on the
# decode path.


class AllocateItem(NamedTuple):
    """One sequence to allocate."""

    token_ids: list[int]  # every token so far (prompt, plus output when recomputing)
    cache_salt: str = ""  # only sequences with the same salt share prefix-cache blocks
    num_lookahead_tokens: int = 0  # slots reserved beyond the tokens, for the next decode steps
    tenant: str = ""  # whose quota the blocks count against ("" = the default tenant)


class ExtendItem(NamedTuple):
    """Room for one sequence to grow."""

    sequence_id: int
    num_tokens: int  # slots wanted beyond the tokens the cache's record holds


class CommitItem(NamedTuple):
    """Computed tokens of one sequence, reported so the cache can publish its full blocks."""

    sequence_id: int
    token_ids: list[int]  # token ids to append to the cache's record of the sequence
    num_computed_tokens: int  # leading tokens whose KV is now written in the pool


class BlockCache(Protocol):
    """The calls the scheduler makes. Every method is batched and all-or-nothing.

    Extend, Free and SwapOut take `commits` too, applied first and all or nothing with the
    rest of the call, so a decode step reports what it wrote without a Commit of its own.
    Each raises NoFreeBlocks when the cache has no room and CacheUnavailable when it is gone.
    """

    block_size: int  # tokens per block
    max_model_len: int  # tokens a sequence may hold

    async def allocate(self, items: list[AllocateItem]) -> list[SequenceBlocks]: ...
    async def extend(
        self, items: list[ExtendItem], commits: list[CommitItem] = ()
    ) -> list[SequenceBlocks]: ...
    async def commit(self, items: list[CommitItem]) -> None: ...
    async def free(self, sequence_ids: list[int], commits: list[CommitItem] = ()) -> None: ...
    async def swap_out(
        self, sequence_ids: list[int], commits: list[CommitItem] = ()
    ) -> int: ...  # bytes moved
    async def swap_in(self, sequence_ids: list[int]) -> list[SequenceBlocks]: ...
