"""What the cache service keeps per sequence (``Sequence``) and its cumulative counters.

The values its sequence calls take and return (``AllocateItem``, ``SequenceBlocks``,
``CommitItem``, ...) are ``kvtier.sequence_types``', shared with the clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.block_hash import BlockHash
from kvtier.sequence_types import SequenceBlocks

# The device tier's name (cachesvc.tiers.DeviceTier.name): a Sequence's location while its
# blocks are in the pool. Any other location names a lower tier.
DEVICE = "device"

# What a released entry of a block table reads (a sliding window left the block behind,
# cachesvc.releases): an in-range id that no kernel reads or writes for that position.
PLACEHOLDER_BLOCK = 0


@dataclass(slots=True)
class Sequence:
    """The cache service's record of one sequence."""

    sequence_id: int
    lease_id: str
    token_ids: list[int]
    # Device block ids in token order while on the device; empty while on a lower tier. The
    # first num_released_blocks entries are PLACEHOLDER_BLOCK: released, not held.
    block_table: list[int]
    num_computed_tokens: int  # leading tokens whose KV is written (committed)
    num_cached_tokens: int  # leading tokens that were a prefix hit at Allocate
    location: str  # the name of the tier its blocks are on (cachesvc.tiers): DEVICE, "host", ...
    # Slot ids on the lower tier named by location, in token order; empty while on the device.
    tier_slots: list[int]
    extra: bytes  # extra_key(model, tenant_salt, adapter_id) of this sequence
    # The prompt as pack_token_ids bytes, kept from Allocate so publishing its blocks (Commit,
    # SwapIn) does not convert the same token ids again. 4 bytes per prompt token.
    prompt_bytes: bytes
    # Hashes of the leading full blocks named so far (the prefix hit, then each block as it is
    # published), in token order; computed once, never recomputed.
    block_hashes: list[BlockHash]
    request_id: str = ""
    tenant: str = ""  # whose quota its blocks count against (SequenceTable's per-tenant limits)
    # Tokens the block table can hold without new blocks: min(len(block_table) * block_size,
    # max_model_len), 0 while on a lower tier. Kept with the table so the per-step Extend check is
    # one comparison.
    room: int = 0
    # Leading blocks of block_table already offered to the prefix index (published, a hit, or
    # a duplicate of a published block). Reset by SwapIn, whose blocks are new.
    num_published_blocks: int = 0
    # Leading positions whose blocks a sliding window left behind and were released (Extend's
    # releases): placeholders in block_table, no slot on a lower tier. Never decreases.
    num_released_blocks: int = 0
    # The SequenceBlocks last handed out, reused until the block table changes (None = rebuild).
    # They are snapshots shared between calls, so callers must treat them as read-only.
    cached_blocks: SequenceBlocks | None = field(default=None, repr=False, compare=False)

    @property
    def num_blocks(self) -> int:
        """Blocks held, on whichever tier the sequence lives (released entries hold none)."""
        if self.location == DEVICE:
            return len(self.block_table) - self.num_released_blocks
        return len(self.tier_slots)

    @property
    def live_blocks(self) -> list[int]:
        """The device block ids held, in token order: the table past its released entries (the
        table itself when none is released, not a copy: read only)."""
        n = self.num_released_blocks
        return self.block_table[n:] if n else self.block_table


@dataclass
class CacheStats:
    """Cumulative counters since the service started, read by GetStats. Units: tokens, blocks, bytes."""

    prefix_query_tokens: int = 0  # prompt tokens looked up by allocate
    prefix_hit_tokens: int = 0  # of those, tokens served from the prefix cache
    num_swap_out_blocks: int = 0
    num_swap_in_blocks: int = 0
    num_swap_out_bytes: int = 0
    num_swap_in_bytes: int = 0
    num_window_released_blocks: int = 0  # blocks released by Extend's releases (sliding windows)
