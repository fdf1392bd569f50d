"""The host block cache: published blocks evicted from the device pool live on in host memory.

A block is kept under its prefix-index key (``kvtier.block_hash``: ``parent-or-extra || token
ids``), the key ``BlockManager.prefix_index`` uses, so a prompt's chain is followed the same way
on every tier: ``lookup_chain`` counts how many of a prompt's leading keys the cache holds, and
``load`` copies one back into a device block. Entries are LRU within a budget of slots.

Backing memory is a ``cachesvc.host_slots.HostSlots`` (one uint8 tensor ``[num_slots,
block_bytes]``, pinned on CUDA, and the copies to and from pool blocks). Swap space and cached
blocks share it, swap first:
``take_slots`` hands the swap side free slots, evicting cached entries (LRU first) to make room,
and ``release_slots`` gives them back to the cache. An evicted entry goes to ``on_evict(key,
parent_hash, data)`` before its slot is reused (the disk tier's ``offer`` has that signature);
``data`` is the slot's row, valid only during the call.

Every eviction of a device block with a host cache lands here (``keep_rows``), so a batch is
taken in one go: its slots claimed together (free ones, then the LRU victims', popped by
``cachesvc.slot_lru`` without a Python step per entry), its keys added in one update, one
``on_change`` call per batch. An entry is its key and slot only (a parent hash other than the
key's first 32 bytes is kept aside): no object per cached block for the garbage collector.
Every copy is complete when the call returns (``HostSlots``), so a device block handed to
``offer`` may be reused, and a block filled by ``load`` read, at once. Single-threaded: the
cache service's loop calls every method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.cachesvc.errors import InvalidArgument, ResourceExhausted
from kvtier.cachesvc.host_slots import HostSlots, flat_bytes
from kvtier.cachesvc.slot_lru import SlotLru

EvictSink = Callable[[bytes, "bytes | None", torch.Tensor], object]
ChangeSink = Callable[[bool, Sequence[bytes], Sequence[int]], object]
ReplaceSink = Callable[[Sequence[bytes], Sequence[bytes], Sequence[int]], object]


@dataclass(slots=True)
class HostEntry:
    """One cached block as ``entry`` reports it: its index key, its parent's hash (None for a
    first block offered without one), its slot."""

    key: bytes
    parent_hash: bytes | None
    slot: int


class HostBlockCache:
    """``num_slots`` host slots of ``block_bytes`` each, shared by cached blocks and swap.

    Units: slots (one block each) and bytes. Every method is O(blocks touched).
    """

    def __init__(
        self,
        num_slots: int,
        block_bytes: int,
        *,
        device: str | torch.device = "cpu",
        on_evict: EvictSink | None = None,
    ) -> None:
        if num_slots < 0 or block_bytes <= 0:
            raise InvalidArgument(
                f"host cache of {num_slots} slots x {block_bytes} bytes: need >= 0 slots, > 0 bytes"
            )
        self.area = HostSlots(num_slots, block_bytes, device)
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.slots, self.stream = self.area.slots, self.area.stream  # the rows; the side stream on CUDA
        self.on_evict = on_evict
        self.on_change: ChangeSink | None = None
        """Called ``(stored, keys, slots)`` as entries enter (True) or leave (False) the cache, once
        per batch, in order (the tier's KV events: ``LowerTiers``)."""
        self.on_replace: ReplaceSink | None = None
        """Called ``(victims, keys, slots)`` as ``keys`` take the evicted ``victims``' ``slots`` in
        ``keep_rows`` without ``on_evict``, for ``on_change``'s two calls (one event record)."""
        self._entries = SlotLru()  # key -> slot, least recently used first
        # Parent hashes given by offer_many that are not the key's first 32 bytes (tests, a caller
        # with its own parents); empty on the eviction path, whose parents are their keys' prefix.
        self._parents: dict[bytes, bytes | None] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: lowest slot ids first
        self._swap_slots: set[int] = set()
        self._counts = dict.fromkeys(("hits", "promotions", "evictions", "stored", "rejected"), 0)

    @classmethod
    def from_budget(cls, budget_bytes: int, block_bytes: int, **kwargs) -> HostBlockCache:
        """A cache of ``budget_bytes // block_bytes`` slots (``--host-cache-gib`` in bytes)."""
        return cls(max(0, budget_bytes) // block_bytes, block_bytes, **kwargs)

    # ------------------------------------------------------------------ cached blocks

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def held_keys(self):
        """A live, read-only view of the keys held (``in`` on it costs no Python call)."""
        return self._entries.slots.keys()

    def offer(self, key: bytes, parent_hash: bytes | None, block_view: torch.Tensor) -> bool:
        """``offer_many`` for one block."""
        return self.offer_many([(key, parent_hash, block_view)]) == 1

    def offer_many(self, blocks: Sequence[tuple[bytes, bytes | None, torch.Tensor]]) -> int:
        """Copy published blocks (``(key, parent_hash, block_view)``) in; return how many were taken
        (one evicted again by a later block of the same batch counts: it went to ``on_evict``).

        ``block_view`` is one pool block (``pool[block_id]``, contiguous, ``block_bytes`` bytes)
        on this cache's device. A key already held is only touched. A block that finds no slot
        (every slot is swap's) is not held (counted as rejected). Least recently used entries
        are evicted to make room. The copies are complete when this returns.
        """
        views = []
        for _, _, view in blocks:
            flat = flat_bytes(view)
            if flat.numel() != self.block_bytes:
                raise InvalidArgument(
                    f"block of {flat.numel()} bytes offered to a host cache of {self.block_bytes}-byte slots"
                )
            views.append(flat)
        keys = [k for k, _, _ in blocks]
        parents = [p for _, p, _ in blocks]
        held = 0
        if len(set(keys)) < len(keys) or not self._entries.slots.keys().isdisjoint(keys):
            keys, views, parents, held = self._skip_held(keys, views, parents)
        return held + self._take(keys, views, self.area.copy_in, parents)

    def offer_rows(self, keys: Sequence[bytes], rows: torch.Tensor, row_ids: Sequence[int]) -> int:
        """``offer_many`` of CPU pool rows: block i is ``rows[row_ids[i]]`` (``rows``: the pool as a
        contiguous ``[num_blocks, block_bytes]`` uint8 tensor), its parent hash its key's first
        32 bytes; ``keys`` are distinct (a batch of device evictions). The whole batch in one
        pass (module docstring): every eviction pays this with a host cache
        (bench/block_manager_ab.py --tiers). A CUDA pool goes through offer_many."""
        if rows.is_cuda or self.stream is not None:
            return self.offer_many([(k, k[:32], rows[i]) for k, i in zip(keys, row_ids, strict=True)])
        if rows is not self.area.rows:  # checked and viewed once per pool (keep passes the same one)
            self.area.bind_rows(rows)
        return self.keep_rows(row_ids, keys)

    def keep_rows(self, row_ids: Sequence[int], keys: Sequence[bytes]) -> int:
        """``offer_rows`` of the bound pool (``area.bind_rows``), in the order of the device tier's
        ``on_evict`` hook, which it is when the host cache is the only lower tier
        (``LowerTiers``): one call per Allocate or Extend that evicts.

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
                if self.on_change is not None:
                    self.on_change(True, keys, (slot,))
            else:
                victim, slot = entries.swap_oldest(keys[0])
                self._replaced((victim,), keys, (slot,))
            self.area.copy_row(slot, row_ids[0])
            self._counts["stored"] += 1
            return 1
        fresh = entries.slots.keys().isdisjoint(keys)
        if n > (room or len(entries.slots)) or not fresh:
            held = 0
            if not fresh:
                keys, row_ids, _, held = self._skip_held(keys, row_ids, None)
            return held + self._take(keys, row_ids, self.area.copy_rows)
        if room:  # free slots first: none evicted
            return self._store(keys, row_ids, self.area.copy_rows, None)
        victims, slots = entries.pop_oldest(n)
        entries.add(keys, slots)
        self._replaced(victims, keys, slots)
        self.area.copy_rows(slots, row_ids)
        self._counts["stored"] += n
        return n

    def _take(
        self, keys: Sequence[bytes], sources: Sequence, copy: Callable, parents: Sequence | None = None
    ) -> int:
        """Take blocks ``keys``, none held, distinct (parent hashes ``parents``; None: each key's
        first 32 bytes), block i's bytes from ``sources[i]`` through ``copy(slots, sources)``;
        return how many were taken. ``offer_many``'s bookkeeping for either kind of source."""
        room = len(self._free) + len(self._entries)
        if len(keys) <= room:  # one round: the rule
            return self._store(keys, sources, copy, parents)
        # A batch larger than the cache goes in rounds of `room`: a round is copied before the
        # next one evicts it, so what on_evict receives is the block, not the slot's old bytes.
        held = 0
        while keys and room:
            held += self._store(keys[:room], sources[:room], copy, parents and parents[:room])
            keys, sources, parents = keys[room:], sources[room:], parents and parents[room:]
            room = len(self._free) + len(self._entries)
        self._counts["rejected"] += len(keys)  # every slot is swap's
        return held

    def _store(
        self, keys: Sequence[bytes], sources: Sequence, copy: Callable, parents: Sequence | None
    ) -> int:
        """``_take`` of at most as many blocks as there are free or cached slots."""
        slots = self._claim(len(keys))
        self._entries.add(keys, slots)
        if parents is not None:
            self._keep_parents(keys, parents)
        if self.on_change is not None:
            self.on_change(True, keys, slots)
        copy(slots, sources)
        self._counts["stored"] += len(slots)
        return len(slots)

    def _skip_held(self, keys: Sequence[bytes], sources: Sequence, parents: Sequence | None) -> tuple:
        """A batch without the keys already held (each touched: most recently used) or repeated
        within it; returns ``(keys, sources, parents, how many were left out)``."""
        entries, held = self._entries, self._entries.slots
        new: dict[bytes, int] = {}  # key -> its position in the batch
        for k, key in enumerate(keys):
            if key in held:
                entries.touch(key)
            elif key not in new:
                new[key] = k
        at = list(new.values())
        kept_parents = [parents[k] for k in at] if parents is not None else None
        return list(new), [sources[k] for k in at], kept_parents, len(keys) - len(at)

    def _keep_parents(self, keys: Sequence[bytes], parents: Sequence) -> None:
        """Remember the parent hashes of ``keys`` that are not their key's first 32 bytes."""
        for key, parent in zip(keys, parents, strict=True):
            if parent != key[:32]:
                self._parents[key] = parent

    def _parent(self, key: bytes) -> bytes | None:
        """``key``'s parent hash, forgotten (its entry is leaving)."""
        return self._parents.pop(key, key[:32]) if self._parents else key[:32]

    def lookup_chain(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the cache holds (each counted as a hit); LRU order unchanged."""
        held = self._entries.slots
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        self._counts["hits"] += n
        return n

    def load(self, key: bytes, dst_view: torch.Tensor) -> bool:
        """``load_many`` for one block."""
        return self.load_many([key], [dst_view]) == 1

    def load_many(self, keys: Sequence[bytes], dst_views: Sequence[torch.Tensor]) -> int:
        """Copy the blocks of the leading held ``keys`` into ``dst_views`` (pool blocks); return how many.

        Stops at the first key not held (the rest of a chain is useless without it). Each loaded
        entry becomes the most recently used and stays cached. Complete when this returns.
        """
        if len(keys) != len(dst_views):
            raise InvalidArgument(f"len(keys) = {len(keys)} != len(dst_views) = {len(dst_views)}")
        slots: list[int] = []
        for key in keys:
            slot = self._entries.slots.get(key)
            if slot is None:
                break
            self._entries.touch(key)
            slots.append(slot)
        views = [flat_bytes(v) for v in dst_views[: len(slots)]]
        for k, view in enumerate(views):
            if view.numel() != self.block_bytes:
                raise InvalidArgument(f"dst_views[{k}] has {view.numel()} bytes, a slot {self.block_bytes}")
        self.area.copy_out(slots, views)
        self._counts["promotions"] += len(slots)
        return len(slots)

    def entry(self, key: bytes) -> HostEntry | None:
        """The entry held under ``key`` (its slot row is ``slots[entry.slot]``), or None."""
        slot = self._entries.slots.get(key)
        if slot is None:
            return None
        return HostEntry(key, self._parents.get(key, key[:32]), slot)

    def touch(self, key: bytes) -> bool:
        """Make ``key`` the most recently used entry; False if it is not held."""
        if key not in self._entries:
            return False
        self._entries.touch(key)
        return True

    def evict(self, num_blocks: int = 1) -> int:
        """Evict up to ``num_blocks`` least recently used entries (each to ``on_evict``); return how many."""
        n = min(num_blocks, len(self._entries))
        self._free += self._evict_lru(n)
        return n

    def discard(self, key: bytes) -> bool:
        """Drop ``key`` without handing it to ``on_evict`` (it is back on the device); False if not held."""
        slot = self._entries.remove(key)
        if slot is None:
            return False
        self._parents.pop(key, None)
        self._free.append(slot)
        if self.on_change is not None:
            self.on_change(False, (key,), (slot,))
        return True

    # ------------------------------------------------------------------ swap's share

    def take_slots(self, num_slots: int) -> list[int]:
        """``num_slots`` slots for swap, evicting cached entries (LRU first) as needed.

        Raises ResourceExhausted, changing nothing, if fewer slots are free or cached than asked.
        """
        room = len(self._free) + len(self._entries)
        if num_slots > room:
            raise ResourceExhausted(
                f"host area: swap needs {num_slots} slots but only {room} of {self.num_slots} are not swap's "
                f"({len(self._swap_slots)} are); raise --host-cache-gib"
            )
        taken = self._claim(num_slots)
        self._swap_slots.update(taken)
        return taken

    @property
    def num_swap_slots(self) -> int:
        """Slots swap holds now."""
        return len(self._swap_slots)

    def swap_slot_ids(self) -> list[int]:
        """Swap's slots, ascending (for the invariants)."""
        return sorted(self._swap_slots)

    def release_slots(self, slots: Sequence[int]) -> None:
        """Give swap slots back to the cache."""
        for k, s in enumerate(slots):
            if s not in self._swap_slots:
                raise InvalidArgument(f"slots[{k}] = {s} is not a swap slot of this host area")
        for s in slots:
            self._swap_slots.remove(s)
            self._free.append(s)

    # ------------------------------------------------------------------ figures

    def stats(self) -> dict:
        """blocks and bytes cached, swap slots, free slots, hits, promotions, evictions, stored, rejected."""
        return {
            "blocks": len(self._entries),
            "bytes": len(self._entries) * self.block_bytes,
            "capacity_blocks": self.num_slots,
            "swap_slots": len(self._swap_slots),
            "free_slots": len(self._free),
            **self._counts,
        }

    def check_invariants(self) -> None:
        """AssertionError unless every slot is exactly one of free, cached or swap's. O(num_slots)."""
        cached = list(self._entries.slots.values())
        every = sorted([*self._free, *cached, *self._swap_slots])
        assert every == list(range(self.num_slots)), f"slots free/cached/swap overlap or leak: {every}"

    # ------------------------------------------------------------------ internals

    def _claim(self, n: int) -> list[int]:
        """``n`` slots: free ones first (lowest ids first), then those of the least recently used
        entries, evicted. Needs ``n <= len(_free) + len(_entries)``."""
        free = self._free
        k = min(n, len(free))
        slots = free[len(free) - k :]
        slots.reverse()  # the stack's order: popped from its end
        del free[len(free) - k :]
        if n > k:
            slots += self._evict_lru(n - k)
        return slots

    def _evict_lru(self, n: int) -> list[int]:
        """Evict the ``n`` least recently used entries (one on_change call, then each to ``on_evict``);
        return their (now unused) slots, oldest first."""
        if n <= 0:
            return []
        keys, slots = self._entries.pop_oldest(n)
        self._evicted(keys, slots)
        return slots

    def _replaced(self, victims: Sequence[bytes], keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Count and announce ``keys`` taking the evicted ``victims``' ``slots`` (their bytes still
        there): ``on_replace``, or without it or with an ``on_evict``, ``_evicted`` and ``on_change``."""
        if self.on_replace is None or self.on_evict is not None:
            self._evicted(victims, slots)
            if self.on_change is not None:
                self.on_change(True, keys, slots)
            return
        self._counts["evictions"] += len(victims)
        for key in victims if self._parents else ():
            self._parents.pop(key, None)
        self.on_replace(victims, keys, slots)

    def _evicted(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Count and announce entries ``keys`` that left their ``slots`` (one on_change call, then
        each to ``on_evict`` while its slot still holds its bytes)."""
        self._counts["evictions"] += len(keys)
        if self.on_change is not None:
            self.on_change(False, keys, slots)
        if self.on_evict is not None:
            rows = self.slots
            for key, slot in zip(keys, slots, strict=True):
                self.on_evict(key, self._parent(key), rows[slot])
        elif self._parents:
            for key in keys:
                self._parents.pop(key, None)
