"""Pool slot metadata (`Block`) and the LRU queue of unreferenced blocks that links them.

Only `FreeBlockQueue` reads or writes a block's ``prev_free`` / ``next_free`` links; the block
manager moves blocks in and out of the queue with its batch operations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.block_hash import BlockHash


class OverFreed(Exception):
    """``release`` met a block whose reference count is already 0; nothing was changed."""

    def __init__(self, position: int, block_id: int) -> None:
        super().__init__(f"block_ids[{position}] = {block_id} is not referenced (ref_cnt 0)")
        self.position = position
        self.block_id = block_id


class Block:
    """One pool slot's metadata. Also the node of the intrusive free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "index_key", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # The preimage the prefix index files this block under; None exactly when block_hash is.
        self.index_key: bytes | None = None
        # Links of the free queue, meaningful only while the block is in it (see FreeBlockQueue).
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """LRU queue of unreferenced blocks: an intrusive doubly linked list between two sentinels.

    The head is the least recently freed block (the next one allocation takes); freed blocks go
    to the tail. Removing a block from the middle (a prefix hit on a free cached block) is O(1),
    unlike ``deque.remove``. The links live on the blocks, so the queue allocates nothing.

    A block is in the queue exactly when its reference count is 0, so the queue also owns the
    transitions of that count across 0: ``acquire`` (a prefix hit), ``pop_acquire_n`` (an
    allocation) and ``release`` (a free) change counts and links in the same pass; the block
    manager calls only these. ``append_n`` (linking blocks whose count is already 0) is the one
    plain list edit: it fills the queue at start.

    NOTE: every operation takes or returns a whole batch and loops inside: these run once per
    block of every sequence, and a method call per block cost more than the list edit itself.
    One pass per batch, too: a separate pass to collect blocks and another to link them cost
    about a tenth of a whole sequence lifecycle (bench/block_manager.py). Callers guarantee
    membership (a block passed to ``append_n`` is not in the queue); nothing is checked on these
    paths but in ``check_links``.
    NOTE: a block leaving the queue keeps its stale links (clearing them cost a sixth of an
    allocation); inserting a block sets both of its links, and whether a block is in the queue is
    decided by its reference count, never by its links.
    """

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self._spare = Block(-1)  # where ``release`` builds its run for the head
        self.num_free = 0
        self.append_n(blocks)

    def append_n(self, blocks: list[Block]) -> None:
        """Link ``blocks`` behind the tail, in order (the last one becomes the newest)."""
        self._insert_after(self.tail.prev_free, blocks)

    def _insert_after(self, prev: Block, blocks: list[Block]) -> None:
        """Link ``blocks``, in order, between ``prev`` and the block now after it."""
        nxt = prev.next_free
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        # The neighbour after the run is re-linked once, at the end.
        prev.next_free = nxt
        nxt.prev_free = prev
        self.num_free += len(blocks)

    # ------------------------------------------------------------ reference-count transitions

    def acquire(self, blocks: list[Block], block_ids: Iterable[int]) -> None:
        """Take one reference on ``blocks[i]`` per ``i`` in ``block_ids``; a block whose count
        was 0 leaves the queue from wherever it sits."""
        taken = 0
        for i in block_ids:
            block = blocks[i]
            if block.ref_cnt == 0:
                prev, nxt = block.prev_free, block.next_free
                prev.next_free = nxt
                nxt.prev_free = prev
                taken += 1
            block.ref_cnt += 1
        self.num_free -= taken

    def pop_acquire_n(self, n: int, ids: list[int]) -> list[Block]:
        """Unlink the ``n`` blocks at the head, give each ref_cnt 1 and append its id to ``ids``.

        Returns the popped blocks that still carry a hash, for the caller to evict. Needs
        ``n <= num_free``.
        """
        cached: list[Block] = []
        append = ids.append
        head = self.head
        block = head.next_free
        for _ in range(n):
            if block.block_hash is not None:
                cached.append(block)
            block.ref_cnt = 1
            append(block.block_id)
            block = block.next_free
        head.next_free = block
        block.prev_free = head
        self.num_free -= n
        return cached

    def pop_acquire_one(self) -> Block:
        """``pop_acquire_n(1, ...)`` without its lists: the head block, unlinked, with ref_cnt 1.
        Needs ``num_free >= 1``."""
        head = self.head
        block = head.next_free
        nxt = block.next_free
        head.next_free = nxt
        nxt.prev_free = head
        block.ref_cnt = 1
        self.num_free -= 1
        return block

    def release(self, blocks: list[Block], block_ids: Sequence[int]) -> int:
        """Drop one reference on ``blocks[i]`` per ``i`` in ``block_ids``, in order; return how
        many reached 0.

        A block reaching 0 that carries a hash goes behind the tail, in order: it stays
        findable longest. One that carries none (a partial or never-published block, worth
        nothing to anyone) goes to the head, to be reused before any cached block.
        An id whose count is already 0 raises ``OverFreed`` naming its position, after every
        count and link this call changed is put back.
        """
        tail = self.tail
        last = start = tail.prev_free
        # The head run is built behind a spare sentinel and spliced in once, after the loop, so
        # it never shares a link with the tail run (an empty queue has head == start).
        spare = self._spare
        front = spare
        released = 0
        ids = iter(block_ids)
        for i in ids:
            block = blocks[i]
            ref_cnt = block.ref_cnt
            if ref_cnt == 1:
                block.ref_cnt = 0
                if block.block_hash is None:
                    front.next_free = block
                    block.prev_free = front
                    front = block
                else:
                    last.next_free = block
                    block.prev_free = last
                    last = block
                released += 1
            elif ref_cnt:
                block.ref_cnt = ref_cnt - 1
            else:
                # The tail sentinel's prev link and the head run are not in the queue yet:
                # re-linking the old last block drops the tail run; then restore the counts.
                start.next_free = tail
                k = len(block_ids) - 1 - sum(1 for _ in ids)  # the position of `i`: no counter in the loop
                for j in block_ids[:k]:
                    blocks[j].ref_cnt += 1
                raise OverFreed(k, i)
        last.next_free = tail
        tail.prev_free = last
        if front is not spare:
            head = self.head
            first, nxt = spare.next_free, head.next_free
            head.next_free = first
            first.prev_free = head
            front.next_free = nxt
            nxt.prev_free = front
        self.num_free += released
        return released

    def block_ids(self) -> list[int]:
        """Block ids from head (evicted first) to tail. O(num_free): for tests and debugging."""
        ids = []
        block = self.head.next_free
        while block is not self.tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids

    def check_links(self) -> list[Block]:
        """Raise AssertionError on a broken link; return the queued blocks, head to tail. O(queue)."""
        queued: list[Block] = []
        seen: set[int] = set()
        prev, block = self.head, self.head.next_free
        while block is not self.tail:
            assert block is not None, f"free queue broken after block {prev.block_id}"
            assert block.prev_free is prev, f"block {block.block_id}: prev_free is not block {prev.block_id}"
            assert block.block_id not in seen, f"block {block.block_id} appears twice in the free queue"
            seen.add(block.block_id)
            queued.append(block)
            prev, block = block, block.next_free
        assert self.tail.prev_free is prev, "free queue tail sentinel does not point at the last block"
        assert len(queued) == self.num_free, (
            f"free queue holds {len(queued)} blocks, num_free says {self.num_free}"
        )
        return queued
