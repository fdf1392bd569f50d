"""The values of the cache service's calls and replies, one definition used on both sides of the wire.

The compute scheduler builds the items (``computesvc.cache_port``), the cache client turns them
into protobuf (``kvtier.cache_client``), the cache servicer turns protobuf back into them and the
cache domain (``cachesvc.sequences``) takes and returns them. Replies travel the other way: the
domain returns them, the servicer makes protobuf of them and the client turns that back into
them, so no caller of ``CacheClient`` reads a protobuf message. Each mirrors the protobuf message
of the same name in ``proto/kvtier/v1/cache.proto`` (a reply message's name less "Response");
nothing here imports protobuf.

Salts: ``tenant_salt`` is the salt a sequence's blocks are hashed with AFTER the replica bound
the client's ``cache_salt`` to its tenant (``kvtier.api_keys.tenant_salt``). Only the compute
replica and a router see the client's raw ``cache_salt``; everything from the cache call on
carries the bound one, under this name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvtier.block_hash import BlockHash

if TYPE_CHECKING:
    from kvtier.pool import PoolSpec


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


# ---------------------------------------------------------------- replies


class LeaseGrant(NamedTuple):
    """Attach's answer (AttachResponse): the lease every mutating call names, and the pool."""

    lease_id: str
    lease_ttl_s: float  # seconds the lease lives without a call or Heartbeat
    pool: PoolSpec  # what the client maps (kvtier.pool.attach_pool)
    max_batch: int  # most items one call may carry


class SwapResult(NamedTuple):
    """What SwapOut or SwapIn moved (SwapOutResponse / SwapInResponse)."""

    num_blocks: int
    num_bytes: int
    sequences: list[SequenceBlocks]  # SwapIn: the new block tables, one per sequence id; SwapOut: []


class PrefixHit(NamedTuple):
    """LookupPrefix's answer for one prompt (one item of LookupPrefixResponse). Units: tokens,
    whole blocks, not capped (Allocate caps a hit below the prompt's last token)."""

    num_cached_tokens: int  # the leading run cached on the device
    # Per medium below the device (kvtier.media's names, rank order): tokens of the chain past the
    # device hit whose blocks that medium is the first to hold. Empty without lower tiers.
    below: dict[str, int]

    @property
    def total(self) -> int:
        """The leading tokens some tier holds: what Allocate would serve from the cache."""
        return self.num_cached_tokens + sum(self.below.values())


@dataclass(slots=True)
class BlockStored:
    """A block entered the prefix index (its KV is written and committed)."""

    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    block_id: int
    token_ids: list[int]
    medium: str = "device"  # the tier it entered: a medium's name (kvtier.media)


@dataclass(slots=True)
class BlockRemoved:
    """A block left the prefix index (evicted to make room, or the cache was reset)."""

    block_hash: BlockHash
    block_id: int
    medium: str = "device"  # the tier it left


BlockEvent = BlockStored | BlockRemoved


class CacheEvent(NamedTuple):
    """One numbered event of the WatchEvents stream (CacheEvent): ids strictly increase from 1."""

    event_id: int
    event: BlockEvent


class EventBatch(NamedTuple):
    """One WatchEventBatches message: consecutive events, and whether the last was the newest."""

    events: list[CacheEvent]
    caught_up: bool


class HashRun(NamedTuple):
    """Consecutive events of one medium and kind (WatchEventBatches asked ``hashes_only``): event
    ``first_event_id + i`` is about ``hashes[i]``, which entered ``medium`` (``stored``, a
    BlockStored) or left it (a BlockRemoved)."""

    first_event_id: int
    medium: str
    stored: bool
    hashes: list[BlockHash]

    @property
    def last_event_id(self) -> int:
        return self.first_event_id + len(self.hashes) - 1


class RunBatch(NamedTuple):
    """One WatchEventBatches message asked ``hashes_only``: its events as runs, oldest first, and
    whether the last was the newest."""

    runs: list[HashRun]
    caught_up: bool


class HeldBatch(NamedTuple):
    """A WatchEventBatches held message (asked ``start_with_held``): blocks held as of event
    ``as_of``, by medium (its name, their hashes); the last has ``end``, and ``caught_up`` when no
    event came after ``as_of`` before it was sent. The stream's EventBatches follow."""

    held: list[tuple[str, list[BlockHash]]]
    as_of: int
    end: bool
    caught_up: bool


# ---------------------------------------------------------------- GetStats


@dataclass(slots=True)
class LeaseSnapshot:
    """One lease's share of the cache at a snapshot (LeaseStats). Units: sequences, blocks,
    tokens, seconds."""

    lease_id: str  # the first 8 hex digits only: the whole id is the client's secret
    client_name: str
    num_sequences: int  # on the device and on the host
    num_blocks: int  # device blocks of its sequences on the device
    num_host_blocks: int  # host-tier slots of its swapped-out sequences
    expires_in_s: float
    num_tokens: int  # tokens of its sequences on the device, in the blocks they hold


@dataclass(slots=True)
class TenantSnapshot:
    """One tenant's share of the cache (TenantStats): blocks its live sequences hold on either
    tier (a shared prefix block counts once per holder, as the quota counts it) and its quota
    (0 = none)."""

    tenant: str
    num_sequences: int
    num_blocks: int
    max_blocks: int


@dataclass(slots=True)
class TierSnapshot:
    """One tier of the prefix cache (TierStats): blocks and bytes it holds now; hits, promotions,
    evictions, stored and skipped blocks cumulative since start; a write-behind tier's queue."""

    medium: str  # a medium's name (kvtier.media): "device", "host", "disk", ...
    num_blocks: int
    num_bytes: int
    num_hit_blocks: int = 0
    num_promotions: int = 0
    num_evictions: int = 0
    num_stored_blocks: int = 0
    num_skipped_blocks: int = 0  # offered, not taken: a full write queue, no room, the tier off
    write_queue_depth: int = 0


@dataclass(slots=True)
class CacheSnapshot:
    """The cache's numbers at one moment (GetStats, metrics). Field names are GetStatsResponse's.

    Units: blocks unless a name says tokens or bytes; counters (prefix tokens, evictions, swaps,
    expired leases) are cumulative since the service started.
    """

    num_blocks_total: int
    num_blocks_free: int  # in the free queue, cached or empty
    num_blocks_used: int  # referenced by a sequence (free + used + fenced = total)
    num_blocks_cached: int  # holding a hash in the prefix index, referenced or not
    usage_percent: float  # (used + fenced) / total, 0..100: what is not free
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evictions: int
    num_host_blocks_total: int
    num_host_blocks_used: int
    num_swap_out_blocks: int
    num_swap_in_blocks: int
    num_swap_out_bytes: int
    num_swap_in_bytes: int
    num_sequences: int
    num_swapped_sequences: int
    leases: list[LeaseSnapshot]
    block_size: int  # tokens per block
    num_expired_leases: int
    num_tokens: int  # tokens of every sequence on the device
    num_token_slots: int  # tokens their block tables have room for
    tenants: list[TenantSnapshot] = field(default_factory=list)
    max_blocks_per_lease: int = 0  # 0 = no limit
    num_blocks_fenced: int = 0  # held back from expired leases (fencing), neither free nor used
    num_window_released_blocks: int = 0  # released by Extend's releases since start (sliding windows)
    tiers: list[TierSnapshot] = field(default_factory=list)  # the prefix cache per tier
    # The pool's: filled in by the servicer, which knows the pool (empty in the domain's own).
    kv_cache_dtype: str = ""  # kvtier.kv_dtypes' name
    block_bytes: int = 0  # bytes of one block, a quantized dtype's scales included

    @property
    def num_leases(self) -> int:
        return len(self.leases)
