"""The values of the calls on a sequence, one definition used on both sides of the wire.

The compute scheduler builds them (``computesvc.cache_port``), the cache client turns them into
protobuf (``kvtier.cache_client``), the cache servicer turns protobuf back into them and the
cache domain (``cachesvc.sequences``) takes and returns them. Each mirrors the protobuf message
of the same name in ``proto/kvtier/v1/cache.proto``; nothing here imports protobuf.

Salts: ``tenant_salt`` is the salt a sequence's blocks are hashed with AFTER the replica bound
the client's ``cache_salt`` to its tenant (``kvtier.api_keys.tenant_salt``). Only the compute
replica and a router see the client's raw ``cache_salt``; everything from the cache call on
carries the bound one, under this name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(slots=True)
class AllocateItem:
    """One sequence to allocate: its tokens and how to key and size it. Units: tokens."""

    token_ids: list[int]  # the prompt (plus output so far, when a preempted request recomputes)
    tenant_salt: str = ""  # mixed into every block hash: only equal salts share prefix blocks
    adapter_id: str = ""  # LoRA adapter: part of the prefix-cache key ("" = the base model)
    num_lookahead_tokens: int = 0  # slots reserved beyond the tokens, for the next decode steps
    request_id: str = ""  # the caller's request id, for the cache service's logs and traces
    tenant: str = ""  # whose quota the sequence's blocks count against ("" = the default tenant)


@dataclass(slots=True)
class SequenceBlocks:
    """A sequence's device blocks after Allocate / Extend / SwapIn (a copy, not a live view)."""

    sequence_id: int
    block_table: list[int]  # pool block ids in token order
    num_cached_tokens: int = 0  # leading tokens served from the prefix cache at Allocate
    num_slots: int = 0  # tokens the block table has room for: len(block_table) * block_size


class ExtendItem(NamedTuple):
    """Room for one sequence to grow."""

    sequence_id: int
    num_tokens: int  # slots wanted beyond the tokens the cache's record holds


# NOTE: ExtendItem and CommitItem are NamedTuples (not dataclasses) because Extend and Commit run
# every decode step: unpacking a tuple is the cheapest way to read one, and a plain
# ``(sequence_id, ...)`` tuple is accepted wherever one of them is.


class CommitItem(NamedTuple):
    """Computed tokens of one sequence, reported so the cache can publish its full blocks."""

    sequence_id: int
    token_ids: list[int]  # token ids to append to the cache's record of the sequence
    num_computed_tokens: int  # leading tokens whose KV is now written in the pool


class ReleaseItem(NamedTuple):
    """Leading blocks of one sequence that a sliding window has left behind (Extend carries it)."""

    sequence_id: int
    num_blocks: int  # release the blocks before this block index; the entries become placeholders


class PrefixQuery(NamedTuple):
    """One prompt for LookupPrefix: which of its leading blocks are cached."""

    token_ids: list[int]
    tenant_salt: str = ""
    adapter_id: str = ""
