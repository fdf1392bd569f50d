"""Pool slot metadata (`Block`) and the LRU queue of unreferenced blocks that links them.

Only `FreeBlockQueue` reads or writes a block's ``prev_free`` / ``next_free`` links; the block
manager moves blocks in and out of the queue with its batch operations.
"""

from __future__ import annotations

from kvtier.block_hash import BlockHash


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

    NOTE: every operation takes or returns a whole batch and loops inside: these run once per
    block of every sequence, and a method call per block cost more than the list edit itself.
    Callers guarantee membership (a block passed to ``append_n`` is not in the queue, one
    passed to ``remove_n`` is); nothing is checked on these paths but in ``check_links``.
    NOTE: a block leaving the queue keeps its stale links (clearing them cost a sixth of an
    allocation); inserting a block sets both of its links, and whether a block is in the queue is
    decided by its reference count, never by its links.
    """

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[Block]:
        """Unlink and return the ``n`` blocks at the head, oldest first. Needs ``n <= num_free``."""
        popped: list[Block] = []
        append = popped.append
        head = self.head
        block = head.next_free
        for _ in range(n):
            append(block)
            block = block.next_free
        # The sentinel is re-linked once, after the run.
        head.next_free = block
        block.prev_free = head
        self.num_free -= n
        return popped

    def append_n(self, blocks: list[Block]) -> None:
        """Link ``blocks`` behind the tail, in order (the last one becomes the newest)."""
        self._insert_after(self.tail.prev_free, blocks)

    def appendleft_n(self, blocks: list[Block]) -> None:
        """Link ``blocks`` at the head, in order (the first one is taken next): blocks worth less
        than anything already free, so they are reused and evicted first."""
        self._insert_after(self.head, blocks)

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

    def remove_n(self, blocks: list[Block]) -> None:
        """Unlink each of ``blocks`` from wherever it sits in the queue, O(1) each."""
        for block in blocks:
            prev, nxt = block.prev_free, block.next_free
            prev.next_free = nxt
            nxt.prev_free = prev
        self.num_free -= len(blocks)

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
