"""Tiers: the places below the device pool where a published block's KV lives on, behind one interface.

Shaped like vLLM's secondary-tier interface (``vllm/v1/kv_offload/tiering/base.py``:
``SecondaryTierManager``) and LMCache's storage backends. A tier holds whole blocks under their
prefix-index keys (``kvtier.block_hash``: ``parent-or-extra || token bytes``, the keys the
device's ``BlockManager.prefix_index`` uses), so a prompt's chain is followed the same way on
every medium. What a tier is made of is data: its ``medium`` is a row of ``kvtier.media``
(name, rank, router price, KV-event medium name); configuration names the tiers to build
(``cachesvc.lower_tiers``), and ``cachesvc.lower_tiers.TierStack`` runs the stack below the
device as one loop over an ordered list of tiers:

- **down**: the block manager returns the published blocks an allocation evicted
  (``BlockManager.take_evicted``); the stack hands them to the first tier's ``submit_store``,
  and what each tier evicts to make room (returned, readable until its next call) to the next;
- **back up**: a prompt's keys past the device hit are asked of each tier (``lookup``; a fast
  ``held`` view for the hot path), and the held run is copied into fresh pool blocks with
  ``submit_load`` jobs, whose results ``finished_jobs`` reports.

The contract every tier keeps (tests/test_tier_contract.py runs it against each one):

- ``lookup(key)``: ``HIT`` (a load now succeeds unless the bytes fail their checks), ``MISS``,
  or ``NOT_YET`` (being stored: ask again later). Changes no recency.
- ``submit_store(job)``: take the job's blocks (``rows[row_ids[i]]`` holds ``keys[i]``); their
  bytes are read before it returns (the rows may be overwritten then), the writing may go on
  behind it. Never blocks on a slow medium: a block it cannot take now is skipped and counted
  (``TierCounts.skipped``). A key already held is only touched. Returns the blocks it evicted
  to make room (``Blocks``, readable until this tier's next call) or None.
- ``submit_load(job)``: copy the job's leading held keys into ``rows[row_ids[i]]``, stopping at
  the first it cannot give (a record failing its checks is a miss); ``finished_jobs`` reports
  how many landed. A loaded block stays held (it may be evicted from the device again).
- ``finished_jobs(timeout_s)``: the results of jobs finished since the last call, waiting up to
  ``timeout_s`` for one when none has finished. A tier whose copies complete in the call
  (host memory, disk reads) reports at once.
- ``discard(key)``: forget a block without passing it down.
- ``take_events()``: its KV-event records since the last call (``cachesvc.events``: one record
  per batch, ``tier_kind(stored, medium.name)``).
- ``counts()``, ``close()``.

Swap is not a tier here: it is a reserved share of the host area (``cachesvc.host_cache``),
whole sequences copied out of the pool and back (``cachesvc.swap``). ``DeviceTier`` is the
device pool as swap sees it (slots handed out and taken back by the block manager).

Adding a tier: one module with one ``Tier`` subclass, its row in ``kvtier.media`` and its flags
and construction in ``cachesvc.lower_tiers`` (``TIER_BUILDERS``), docs/architecture.md "Tiers".
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from kvtier.cachesvc.errors import InvalidArgument
from kvtier.media import Medium

if TYPE_CHECKING:
    import torch

    from kvtier.cachesvc.block_manager import BlockManager
    from kvtier.cachesvc.events import EventRecord


class Lookup(enum.IntEnum):
    """A tier's answer for one key (vLLM's LookupResult: hit, miss, retry)."""

    MISS = 0
    HIT = 1
    NOT_YET = 2  # being stored (a queued write, an object in flight): ask again later


@dataclass(slots=True)
class Blocks:
    """Blocks as they move between tiers: block ``i`` is ``keys[i]``, its bytes ``rows[row_ids[i]]``.

    ``rows`` is ``[num_rows, block_bytes]`` uint8 (the pool as ``PoolViews.rows``, or a tier's
    own area, such as the host cache's slots)."""

    keys: Sequence[bytes]
    rows: torch.Tensor
    row_ids: Sequence[int]

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class Job:
    """A store or a load: ``blocks`` are the source rows (store) or the destination rows (load)."""

    job_id: int
    blocks: Blocks


@dataclass(slots=True)
class JobResult:
    """A finished job: ``num_done`` of its blocks stored (taken), or leading blocks loaded."""

    job_id: int
    num_done: int


@dataclass(slots=True)
class TierCounts:
    """One tier's figures for GetStats (``TierStats``) and metrics: held now, and counters since start."""

    blocks: int = 0  # blocks held now
    bytes: int = 0  # their bytes
    hits: int = 0  # keys a lookup for a load found (LookupPrefix excluded)
    promotions: int = 0  # blocks loaded into the pool
    evictions: int = 0  # blocks it evicted to make room
    stored: int = 0  # blocks it took (host: copies; disk: records written)
    skipped: int = 0  # blocks offered it could not take (a full write queue, no room, the tier off)
    queue_depth: int = 0  # blocks taken, not yet written (write-behind media)
    extra: dict = field(default_factory=dict)  # medium-specific figures (GetStats' JSON, logs)


class Tier(ABC):
    """One medium below the device pool, keyed by prefix-index keys (module docstring)."""

    medium: ClassVar[Medium]
    block_bytes: int  # bytes of one block (every layer, K and V, a quantized block's scales)

    @abstractmethod
    def lookup(self, key: bytes) -> Lookup:
        """HIT, MISS or NOT_YET for one key; no recency change."""

    @abstractmethod
    def held(self) -> Container[bytes]:
        """A live, read-only view of the keys ``lookup`` answers HIT for: ``key in held()`` is the
        hot path's question (every Allocate's miss asks it per block), so it must be cheap."""

    @abstractmethod
    def submit_store(self, job: Job) -> Blocks | None:
        """Take ``job``'s blocks (module docstring); the blocks evicted to make room, or None."""

    @abstractmethod
    def submit_load(self, job: Job) -> None:
        """Copy ``job``'s leading held keys into its rows; ``finished_jobs`` reports how many."""

    @abstractmethod
    def finished_jobs(self, timeout_s: float = 0.0) -> list[JobResult]:
        """Jobs finished since the last call; waits up to ``timeout_s`` for one when none has."""

    @abstractmethod
    def discard(self, key: bytes) -> bool:
        """Forget ``key`` without passing it down; False if it was not held."""

    @abstractmethod
    def take_events(self) -> list[EventRecord]:
        """Its KV-event records since the last call, oldest first."""

    @abstractmethod
    def counts(self) -> TierCounts:
        """A snapshot of its figures."""

    def lookup_chain(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` it holds (HIT each)."""
        held = self.held()
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def close(self) -> None:  # noqa: B027 - most tiers have nothing to close
        """Finish what is queued and release the medium (a write-behind tier writes its queue)."""


# ---------------------------------------------------------------- swap's slot tiers (going: issue 32)


@dataclass(slots=True)
class TierStats:
    """Blocks and bytes copied into and out of one tier since the service started."""

    blocks_in: int = 0
    blocks_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class SlotTier(ABC):
    """One place blocks live: ``num_blocks`` slots of ``block_bytes`` bytes each."""

    name: str  # what a Sequence's ``location`` holds while its blocks are here
    block_bytes: int  # bytes of one block (every layer, K and V)
    stats: TierStats

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Capacity in blocks."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now."""

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_used_bytes(self) -> int:
        return self.num_used_blocks * self.block_bytes

    @abstractmethod
    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free slot ids; ResourceExhausted, taking none, if fewer are free."""

    @abstractmethod
    def release(self, ids: list[int]) -> None:
        """Give slots back (the device pool: in the order they should enter the LRU)."""


class LowerTier(SlotTier):
    """A tier below the device pool: it copies whole blocks to and from the pool."""

    @abstractmethod
    def store(self, device_ids: list[int], ids: list[int]) -> None:
        """Copy pool blocks ``device_ids`` into this tier's allocated slots ``ids`` (same order)."""

    @abstractmethod
    def load(self, ids: list[int], device_ids: list[int]) -> None:
        """Copy this tier's slots ``ids`` into pool blocks ``device_ids`` (same order)."""


class DeviceTier(SlotTier):
    """The device pool as a tier: slots are pool blocks, handed out and taken back by the block
    manager (reference counts, LRU, prefix index). ``block_bytes`` is 0 when the table runs
    without a pool (unit tests and benchmarks of the bookkeeping alone)."""

    name = "device"

    def __init__(self, block_manager: BlockManager, block_bytes: int = 0) -> None:
        self.block_manager = block_manager
        self.block_bytes = block_bytes
        self.stats = TierStats()

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        return self.block_manager.allocate(num_blocks)

    def release(self, ids: list[int]) -> None:
        self.block_manager.free(ids)

    def on_evict(self, hook: Callable[[list[int], list[bytes]], None] | None) -> None:
        """The tiered prefix cache's hook (issue 22): ``hook(block_ids, index_keys)`` runs when
        ``allocate`` evicts published blocks, before their slots are reused (their KV is still
        in the pool), so a lower tier keeps them under their prefix-index keys (``LowerTiers.keep``;
        a key's hash is ``hash_preimage(key)``). None: nothing runs."""
        self.block_manager.on_evict = hook


def copy_blocks(src: SlotTier, src_ids: list[int], dst: SlotTier, dst_ids: list[int]) -> int:
    """Copy ``src_ids`` of ``src`` into ``dst_ids`` of ``dst`` (both allocated by the caller;
    nothing is released); returns bytes copied and counts them in both tiers' stats.

    Copies go between the device pool and a lower tier; two lower tiers exchange blocks
    through the device pool (no caller needs it yet).
    """
    if len(src_ids) != len(dst_ids):
        raise InvalidArgument(f"len(src_ids) = {len(src_ids)} != len(dst_ids) = {len(dst_ids)}")
    if isinstance(dst, LowerTier) and isinstance(src, DeviceTier):
        dst.store(src_ids, dst_ids)
    elif isinstance(src, LowerTier) and isinstance(dst, DeviceTier):
        src.load(src_ids, dst_ids)
    else:
        raise InvalidArgument(
            f"no copy from tier {src.name!r} to tier {dst.name!r}: one side must be the device"
        )
    n = len(src_ids)
    num_bytes = n * (dst.block_bytes or src.block_bytes)
    src.stats.blocks_out += n
    src.stats.bytes_out += num_bytes
    dst.stats.blocks_in += n
    dst.stats.bytes_in += num_bytes
    return num_bytes
