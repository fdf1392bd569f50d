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
- ``submit_store(blocks, pass_down)``: take the blocks (``rows[row_ids[i]]`` holds ``keys[i]``,
  keys distinct); their bytes are read before it returns (the rows may be overwritten then), the
  writing may go on behind it. Never blocks on a slow medium: a block it cannot take now is
  skipped and counted (``TierCounts.skipped``). A key already held (or queued) is only touched.
  With ``pass_down`` it returns the blocks it evicted to make room, their bytes in rows of their
  own (the slots they left are reused at once) and their tenants, for the tier below (a tier
  that evicts on its own thread, the disk's writer: those since its last such store); else None. A store's source
  rows are released when it returns, so a store reports no job result.
- ``submit_load(job)``: copy the job's leading held keys into ``rows[row_ids[i]]``, stopping at
  the first it cannot give (a record failing its checks is a miss); ``finished_jobs`` reports
  how many landed. A loaded block stays held (it may be evicted from the device again).
- ``finished_jobs(timeout_s)``: the results of load jobs finished since the last call, waiting
  up to ``timeout_s`` for one when none has finished. A tier whose copies complete in the call
  (host memory, disk reads) reports at once.
- ``discard(key)``: forget a block without passing it down.
- tenants: ``Blocks.tenants`` and ``Job.tenant`` say whose blocks move, ``held_for(tenant)`` and
  ``lookup_chain(keys, tenant)`` look as that tenant. A tier that passes blocks down keeps each
  block's tenant and returns it with its evictions; only the shared tier stores and looks up as
  it (a tenant's objects count against its quota in the store and live in its namespace).
- ``take_events()``: its KV-event records since the last call (``cachesvc.events``: one record
  per batch, ``tier_kind(stored, medium.name)``).
- ``counts()``, ``close()``.

Swap is not a tier here: it is a reserved share of the host area (``cachesvc.host_cache``),
whole sequences copied out of the pool and back (``cachesvc.swap``). ``DeviceTier`` is the
device pool as swap sees it (slots handed out and taken back by the block manager).

Adding a tier: one module with one ``Tier`` subclass, its row in ``kvtier.media`` and its builder
(and flags) in ``cachesvc.lower_tiers`` (``TIER_BUILDERS``); tests/test_tier_contract.py gains one
fixture entry. docs/architecture.md, "Tiers".
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

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
    # Block i's tenant (kvtier's name; "" the default tenant), where the caller knows it: the
    # device's evictions and publications do, and host and disk keep it (a slot's, a record's)
    # and pass it down with their evictions. Empty: every block the default tenant's. The shared
    # tier stores as it.
    tenants: Sequence[str] = ()

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class Job:
    """A load: ``blocks`` name the keys and the pool rows to copy them into."""

    job_id: int
    blocks: Blocks
    tenant: str = ""  # whose sequence the load is for (the shared tier asks the store as that tenant)


@dataclass(slots=True)
class JobResult:
    """A finished load: ``num_done`` of its leading blocks landed in their rows."""

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

    lock: AbstractContextManager = nullcontext()  # held while the tier's own threads change its index

    def held_now(self) -> list[bytes]:
        """The keys held now, a list (WatchEventBatches' held blocks): ``held()`` copied under the
        tier's ``lock`` (the disk's writer thread changes its index)."""
        with self.lock:
            return list(self.held())

    @abstractmethod
    def submit_store(self, blocks: Blocks, pass_down: bool = False) -> Blocks | None:
        """Take ``blocks`` (module docstring). With ``pass_down`` (a tier below will take them),
        return the blocks evicted to make room with their bytes (rows of their own), or None."""

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

    def held_for(self, tenant: str) -> Container[bytes]:
        """``held()`` as ``tenant`` sees it: the same view on a tier that keeps no tenant; the
        shared tier asks the store in that tenant's namespace."""
        return self.held()

    def lookup_chain(self, keys: Sequence[bytes], tenant: str = "") -> int:
        """How many leading ``keys`` it holds (HIT each) for ``tenant``."""
        held = self.held_for(tenant)
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def direct_store(self, rows: torch.Tensor) -> Callable[[Sequence[int], Sequence[bytes]], object] | None:
        """For a stack with this tier alone below the pool ``rows`` (nothing below to pass
        evictions to, nothing filtered): ``submit_store`` of ``rows``' blocks as a call taking
        ``(row ids, keys)`` and keeping neither list, so the stack hands over the block
        manager's own lists with no ``Blocks`` built (every evicting Allocate or Extend). None
        (the default): the stack calls ``submit_store``."""
        return None

    def close(self) -> None:  # noqa: B027 - most tiers have nothing to close
        """Finish what is queued and release the medium (a write-behind tier writes its queue)."""


class DeviceTier:
    """The device pool as swap sees it: slots are pool blocks, handed out and taken back by the
    block manager (reference counts, LRU, prefix index). ``block_bytes`` is 0 when the table runs
    without a pool (unit tests and benchmarks of the bookkeeping alone)."""

    name = "device"  # a device Sequence's location (cachesvc.records.DEVICE)

    def __init__(self, block_manager: BlockManager, block_bytes: int = 0) -> None:
        self.block_manager = block_manager
        self.block_bytes = block_bytes

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
