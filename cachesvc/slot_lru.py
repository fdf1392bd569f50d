"""Keys held in slots, in least-recently-used order, with batch operations that run in C loops.

The host block cache (``cachesvc.host_cache``) takes every block the device pool evicts, and
gives up its own least recently used blocks to make room, a batch per Allocate or Extend
(bench/block_manager_ab.py --tiers). An ``OrderedDict`` costs a linked node per key and a Python
step per popped entry; here a plain dict maps key -> slot and a list holds the keys in the order
they were last used, oldest first from ``_head``: adding a batch is one ``dict.update`` and one
``list +=``, taking the ``n`` oldest a slice and one ``map(dict.pop, ...)`` (about 2% of a
lifecycle less than an ``OrderedDict``, bench/block_manager_ab.py --tiers; fewer cache lines per
entry: eviction is bound by memory, not by the interpreter).

Touching or removing a key leaves its earlier place in the list behind, stale; ``_stale`` counts
them per key (a key's live place is always its last), and taking the oldest skips them. Without
touches or removals (a cache that only takes evictions: no hits) no Python step runs per key.
The list is compacted when its consumed head or its stale places outgrow the live keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class SlotLru:
    """``key -> slot`` for distinct keys, least recently used first. Units: entries."""

    def __init__(self) -> None:
        self.slots: dict[bytes, int] = {}  # key -> slot (read it; change it only through methods)
        self._order: list[bytes] = []  # keys by last use, oldest first from _head; some stale
        self._head = 0
        self._stale: dict[bytes, int] = {}  # key -> how many of its places before the last are stale
        self._num_stale = 0

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots

    def add(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Hold ``keys`` (none held yet, distinct) in ``slots``, as the most recently used, in order."""
        self.slots.update(zip(keys, slots, strict=True))
        self._order += keys

    def add_one(self, key: bytes, slot: int) -> None:
        """``add([key], [slot])`` without the lists."""
        self.slots[key] = slot
        self._order.append(key)

    def touch(self, key: bytes) -> None:
        """Make the held ``key`` the most recently used."""
        self._order.append(key)
        self._mark_stale(key)

    def remove(self, key: bytes) -> int | None:
        """Stop holding ``key``; its slot, or None if it was not held."""
        slot = self.slots.pop(key, None)
        if slot is not None:
            self._mark_stale(key)
        return slot

    def pop_oldest(self, n: int) -> tuple[list[bytes], list[int]]:
        """Stop holding the ``n`` least recently used keys (``n <= len(self)``); ``(keys, slots)``,
        oldest first."""
        order, head = self._order, self._head
        keys = order[head : head + n]
        head += n
        if self._stale:
            keys, head = self._skip_stale(keys, head, n)
        self._head = head
        if head > 1024 and head * 2 > len(order):
            self._drop_head()
        return keys, list(map(self.slots.pop, keys))

    def swap_oldest(self, key: bytes) -> tuple[bytes, int]:
        """Stop holding the least recently used key and hold ``key`` (not held) in its slot, as
        the most recently used (``len(self) >= 1``); ``(the key that left, the slot)``. A
        ``pop_oldest(1)`` and ``add`` without their lists: one block evicted by Extend."""
        if self._stale:
            (old,), (slot,) = self.pop_oldest(1)
        else:
            order = self._order
            old = order[self._head]
            self._head += 1
            slot = self.slots.pop(old)
            if self._head > 1024 and self._head * 2 > len(order):
                self._drop_head()
        self.slots[key] = slot
        self._order.append(key)
        return old, slot

    def _drop_head(self) -> None:
        """Forget the places taken from the head: one memmove per about len(self) keys taken."""
        del self._order[: self._head]
        self._head = 0

    def oldest_first(self) -> list[bytes]:
        """The held keys, least recently used first. O(places): for tests and checks."""
        return self._order_live()

    def _skip_stale(self, keys: list[bytes], head: int, n: int) -> tuple[list[bytes], int]:
        """``keys`` (the places taken from the head) without stale places, topped up from the
        order to ``n`` live keys; returns them and the new head."""
        stale, order = self._stale, self._order
        live: list[bytes] = []
        while True:
            for key in keys:
                count = stale.get(key)
                if count:
                    self._num_stale -= 1
                    if count == 1:
                        del stale[key]
                    else:
                        stale[key] = count - 1
                else:
                    live.append(key)
            missing = n - len(live)
            if not missing:
                return live, head
            keys = order[head : head + missing]
            head += missing

    def _mark_stale(self, key: bytes) -> None:
        """``key``'s last place so far is stale now; rebuild the order if stale places outnumber
        the live keys (touches with no evictions would grow it without bound)."""
        self._stale[key] = self._stale.get(key, 0) + 1
        self._num_stale += 1
        if self._num_stale > len(self.slots) + 1024:
            self._order = self._order_live()
            self._head = 0
            self._stale.clear()
            self._num_stale = 0

    def _order_live(self) -> list[bytes]:
        """The held keys by last use, oldest first: each key's last place, if it is held."""
        held = self.slots
        last: Iterable[bytes] = dict.fromkeys(reversed(self._order[self._head :]))
        return [key for key in reversed(list(last)) if key in held]
