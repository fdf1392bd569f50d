"""The host cache: published blocks evicted from the device pool live on in the host area.

A ``kvtier.cachesvc.tiers.Tier`` of medium ``host``: blocks are kept under their prefix-index
keys (``kvtier.block_hash``), LRU within the area's slots. The area is
``cachesvc.host_area.HostArea`` (one uint8 tensor ``[num_slots, block_bytes]``, pinned on CUDA,
and its one copy path); swap's share of it is reserved from the same slots, swap first: a
SwapOut's ``reserve`` gives up cached blocks (least recently used first) to make room.

Every eviction of a device block lands here first (``submit_store``), so a batch is taken in one
go: its slots claimed together (free ones, then the LRU victims', popped by
``cachesvc.slot_lru`` without a Python step per entry), its keys added in one update, one event
record per batch. An entry is its key and slot only (its parent hash is its key's first 32
bytes): no object per cached block for the garbage collector. The blocks it evicts are returned
(their bytes copied aside, with their tenants: a slot keeps the tenant of the block it holds)
when a tier below will take them, and only counted otherwise. Every
copy is complete when the call returns, so a device block handed to ``submit_store`` may be
reused, and a block filled by ``submit_load`` read, at once. Single-threaded: the cache
service's loop calls every method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtier.cachesvc.events import HOST_REPLACED, EventRecord, tier_kind
from kvtier.cachesvc.host_area import HostArea, flat_bytes
from kvtier.cachesvc.slot_lru import SlotLru
from kvtier.cachesvc.tiers import Blocks, Job, JobResult, Lookup, Tier, TierCounts
from kvtier.media import medium

_STORED, _REMOVED = tier_kind(True, "host"), tier_kind(False, "host")


class HostCache(HostArea, Tier):
    """``num_slots`` host slots of ``block_bytes`` each, shared by cached blocks and swap.

    Units: slots (one block each) and bytes. Every method is O(blocks touched).
    """

    medium = medium("host")

    def __init__(self, num_slots: int, block_bytes: int, device: str | torch.device = "cpu") -> None:
        super().__init__(num_slots, block_bytes, device)
        self._entries = SlotLru()  # key -> slot, least recently used first
        self._counts = dict.fromkeys(("hits", "promotions", "evictions", "stored", "skipped"), 0)
        self._events: list[EventRecord] = []
        self._loaded: list[JobResult] = []
        # While a store passes evictions down: (keys, their bytes, their tenants) per evicting
        # step, else None.
        self._out: list[tuple[list[bytes], torch.Tensor, list[str]]] | None = None
        # Each slot's block's tenant ("" the default), kept by the stores that may pass blocks
        # down (submit_store, whose evictions reach the shared tier as their tenant's); keep_rows
        # runs only with nothing below and keeps none (its slots' tenants are never read).
        self._tenants = [""] * num_slots

    @classmethod
    def from_budget(cls, budget_bytes: int, block_bytes: int, **kwargs) -> HostCache:
        """A cache of ``budget_bytes // block_bytes`` slots (``--host-cache-gib`` in bytes)."""
        return cls(max(0, budget_bytes) // block_bytes, block_bytes, **kwargs)

    # ------------------------------------------------------------------ the Tier

    def lookup(self, key: bytes) -> Lookup:
        return Lookup.HIT if key in self._entries.slots else Lookup.MISS

    def held(self):
        """A live, read-only view of the keys held (``in`` on it costs no Python call)."""
        return self._entries.slots.keys()

    def submit_store(self, blocks: Blocks, pass_down: bool = False) -> Blocks | None:
        """Copy ``blocks`` in (keys distinct; one already held is only touched); return the blocks
        evicted to make room, their bytes copied aside, when ``pass_down`` (else None). A block
        that finds no slot (every slot is swap's) is skipped. Complete when this returns."""
        rows, ids, keys = blocks.rows, blocks.row_ids, blocks.keys
        if not pass_down and rows is self.rows:  # the bound CPU pool: every eviction with nothing below
            self.keep_rows(ids, keys)
            return None
        if not pass_down and self.stream is None and not rows.is_cuda:
            self.bind_rows(rows)  # checked and viewed once per pool (the stack passes the same one)
            self.keep_rows(ids, keys)
            return None
        self._out = [] if pass_down else None
        views = [flat_bytes(rows[i]) for i in ids]
        tenants = blocks.tenants or [""] * len(keys)
        if not self._entries.slots.keys().isdisjoint(keys):
            keys, at, _ = self._skip_held(keys, range(len(keys)))
            views, tenants = [views[k] for k in at], [tenants[k] for k in at]
        self._take(keys, views, self.copy_in, tenants)
        out, self._out = self._out, None
        if not out:
            return None
        if len(out) == 1:
            return Blocks(out[0][0], out[0][1], range(len(out[0][0])), out[0][2])
        data = torch.cat([d for _, d, _ in out])
        return Blocks(
            [k for ks, _, _ in out for k in ks], data, range(len(data)), [t for *_, ts in out for t in ts]
        )

    def direct_store(self, rows: torch.Tensor) -> Callable[[Sequence[int], Sequence[bytes]], int] | None:
        """``keep_rows`` bound to ``rows`` (a CPU pool); None with a side stream or a cuda pool."""
        if self.stream is not None or rows.is_cuda:
            return None
        self.bind_rows(rows)
        return self.keep_rows

    def submit_load(self, job: Job) -> None:
        """Copy the leading held keys of ``job`` into its rows; each loaded entry becomes the most
        recently used and stays cached. Complete when this returns (``finished_jobs`` says how many)."""
        blocks = job.blocks
        slots: list[int] = []
        entries = self._entries
        for key in blocks.keys:
            slot = entries.slots.get(key)
            if slot is None:
                break
            entries.touch(key)
            slots.append(slot)
        rows = blocks.rows
        self.copy_out(slots, [flat_bytes(rows[i]) for i in blocks.row_ids[: len(slots)]])
        self._counts["hits"] += len(slots)
        self._counts["promotions"] += len(slots)
        self._loaded.append(JobResult(job.job_id, len(slots)))

    def finished_jobs(self, timeout_s: float = 0.0) -> list[JobResult]:
        done, self._loaded = self._loaded, []
        return done

    def discard(self, key: bytes) -> bool:
        """Drop ``key`` without passing it down (it is back on the device); False if not held."""
        slot = self._entries.remove(key)
        if slot is None:
            return False
        self._free.append(slot)
        self._events.append((_REMOVED, (key,), (slot,)))
        return True

    def take_events(self) -> list[EventRecord]:
        events, self._events = self._events, []
        return events

    def counts(self) -> TierCounts:
        n = len(self._entries)
        c = self._counts
        return TierCounts(
            blocks=n, bytes=n * self.block_bytes, hits=c["hits"], promotions=c["promotions"],
            evictions=c["evictions"], stored=c["stored"], skipped=c["skipped"],
            extra={"capacity_blocks": self.num_slots, "swap_slots": len(self._swap_slots), "free_slots": len(self._free)},
        )  # fmt: skip

    def touch(self, key: bytes) -> bool:
        """Make ``key`` the most recently used entry; False if it is not held."""
        if key not in self._entries:
            return False
        self._entries.touch(key)
        return True

    def oldest_first(self) -> list[bytes]:
        """The held keys, least recently used first (tests)."""
        return self._entries.oldest_first()

    def check_invariants(self) -> None:
        """AssertionError unless every slot is exactly one of free, cached or swap's. O(num_slots)."""
        every = sorted([*self._free, *self._entries.slots.values(), *self._swap_slots])
        assert every == list(range(self.num_slots)), f"slots free/cached/swap overlap or leak: {every}"

    # ------------------------------------------------------------------ the eviction path

    def keep_rows(self, row_ids: Sequence[int], keys: Sequence[bytes]) -> int:
        """``submit_store`` of the bound CPU pool's rows (``bind_rows``) with nothing below to pass
        evictions to: one call per Allocate or Extend that evicts (the host cache alone below
        the device). Returns how many blocks it holds of them.

        The rule (a batch of new keys that fits in the free slots, or, once the cache is full,
        in its oldest entries' slots) runs inline: about 4 of the 23 evictions of a lifecycle are
        single blocks evicted by Extend, where each call layer counts (block_manager_ab --tiers)."""
        entries, free, n = self._entries, self._free, len(keys)
        room = len(free)
        if n == 1 and (room or entries.slots) and keys[0] not in entries.slots:
            # One block (Extend's evictions): a free slot, else the oldest entry's; no list built.
            if room:
                slot = free.pop()  # _claim(1)'s slot
                entries.add_one(keys[0], slot)
                self._events.append((_STORED, tuple(keys), (slot,)))
            else:
                victim, slot = entries.swap_oldest(keys[0])
                self._replaced((victim,), keys, (slot,))
            self.copy_row(slot, row_ids[0])
            self._counts["stored"] += 1
            return 1
        fresh = entries.slots.keys().isdisjoint(keys)
        if n > (room or len(entries.slots)) or not fresh:
            held = 0
            if not fresh:
                keys, row_ids, held = self._skip_held(keys, row_ids)
            return held + self._take(keys, row_ids, self.copy_rows)
        if room:  # free slots first: none evicted
            return self._store(keys, row_ids, self.copy_rows)
        victims, slots = entries.pop_oldest(n)
        entries.add(keys, slots)
        self._replaced(victims, keys, slots)
        self.copy_rows(slots, row_ids)
        self._counts["stored"] += n
        return n

    def _take(self, keys: Sequence[bytes], sources: Sequence, copy: Callable, tenants=None) -> int:
        """Take blocks ``keys``, none held, distinct, block i's bytes from ``sources[i]`` through
        ``copy(slots, sources)`` (its tenant ``tenants[i]``, None: not kept); return how many were taken."""
        room = len(self._free) + len(self._entries)
        if len(keys) <= room:  # one round: the rule
            return self._store(keys, sources, copy, tenants)
        # A batch larger than the cache goes in rounds of `room`: a round is copied before the
        # next one evicts it, so what a tier below receives is the block, not the slot's old bytes.
        held = 0
        while keys and room:
            held += self._store(keys[:room], sources[:room], copy, tenants and tenants[:room])
            keys, sources, tenants = keys[room:], sources[room:], tenants and tenants[room:]
            room = len(self._free) + len(self._entries)
        self._counts["skipped"] += len(keys)  # every slot is swap's
        return held

    def _store(self, keys: Sequence[bytes], sources: Sequence, copy: Callable, tenants=None) -> int:
        """``_take`` of at most as many blocks as there are free or cached slots."""
        slots, _ = self._claim(len(keys), self._out is not None)
        self._entries.add(keys, slots)
        if tenants is not None:
            of = self._tenants
            for slot, tenant in zip(slots, tenants, strict=True):
                of[slot] = tenant
        self._events.append((_STORED, tuple(keys), tuple(slots)))
        copy(slots, sources)
        self._counts["stored"] += len(slots)
        return len(slots)

    def _skip_held(self, keys: Sequence[bytes], sources: Sequence) -> tuple:
        """A batch without the keys already held (each touched: most recently used) or repeated
        within it; returns ``(keys, sources, how many were left out)``."""
        entries, held = self._entries, self._entries.slots
        new: dict[bytes, int] = {}  # key -> its position in the batch
        for k, key in enumerate(keys):
            if key in held:
                entries.touch(key)
            elif key not in new:
                new[key] = k
        at = list(new.values())
        return list(new), [sources[k] for k in at], len(keys) - len(at)

    def _claim(self, n: int, pass_down: bool) -> tuple[list[int], Blocks | None]:
        """``n`` slots: free ones first (lowest ids first), then those of the least recently used
        entries, evicted (their bytes copied aside first when ``pass_down``). Needs
        ``n <= len(_free) + len(_entries)``."""
        free = self._free
        k = min(n, len(free))
        slots = free[len(free) - k :]
        slots.reverse()  # the stack's order: popped from its end
        del free[len(free) - k :]
        if n <= k:
            return slots, None
        keys, victims = self._entries.pop_oldest(n - k)
        self._counts["evictions"] += len(keys)
        self._events.append((_REMOVED, tuple(keys), tuple(victims)))
        evicted = None
        if pass_down:  # a copy: the slots are reused
            evicted = Blocks(keys, self.slots[victims], range(len(keys)), [self._tenants[s] for s in victims])
            if self._out is not None:
                self._out.append((keys, evicted.rows, evicted.tenants))
        return slots + victims, evicted

    def _replaced(self, victims: Sequence[bytes], keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Count and record ``keys`` taking the evicted ``victims``' ``slots``: one HOST_REPLACED
        event record (cachesvc.events)."""
        self._counts["evictions"] += len(victims)
        self._events.append((HOST_REPLACED, (*victims, *keys), tuple(slots)))
