"""Physical KV blocks of the pool: reference counts, the LRU free queue and the prefix index.

No gRPC and no tensors here: block ids are plain ints naming pool slots (the same slot in every
layer). The per-sequence bookkeeping that drives this class lives in ``cachesvc.sequences``.

Block hashes
------------
A full block (``block_size`` tokens) is named by a hash chained over every token before it:

    extra      = sha256(b"kvtier-block-v1\\0" + b"\\0".join(utf8(model_fingerprint), utf8(cache_salt), utf8(adapter_id)))
    block_hash = sha256(parent_hash || extra || token ids of the block as little-endian int32)

``parent_hash`` is the previous block's hash, or 32 zero bytes for the first block of a
sequence. Both digests are 32 bytes. The formula depends on nothing in the process (no
``PYTHONHASHSEED``, no random seed), so a global prefix index elsewhere, fed by the
``BlockStored`` / ``BlockRemoved`` events, computes the same hashes from the same token ids.
Different salts, adapters or models never share a block because ``extra`` differs.

Lifecycle of a block
--------------------
free (in the LRU queue, maybe still cached) --allocate/touch--> referenced --free--> queue tail
--commit--> published in the prefix index (hash set) while referenced or free; evicted from the
index only when ``allocate`` pops it from the queue head because no other block is free.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

from cachesvc.errors import InvalidArgument, ResourceExhausted

BlockHash = NewType("BlockHash", bytes)
"""32-byte sha256 digest naming a full block and, through the chain, its whole prefix."""

_HASH_DOMAIN = b"kvtier-block-v1\0"
_ZERO_HASH = bytes(32)
_sha256 = hashlib.sha256


def extra_key(model_fingerprint: str, cache_salt: str = "", adapter_id: str = "") -> bytes:
    """The 32-byte key mixed into every block hash: model, tenant salt and adapter identity.

    Fields are joined by NUL bytes, so a field may not contain one (it would make two
    different triples collide); that raises InvalidArgument.
    """
    fields = (model_fingerprint, cache_salt, adapter_id)
    for name, value in zip(("model_fingerprint", "cache_salt", "adapter_id"), fields, strict=True):
        if "\0" in value:
            raise InvalidArgument(f"{name} = {value!r} contains a NUL character, which is not allowed")
    return _sha256(_HASH_DOMAIN + b"\0".join(f.encode("utf-8") for f in fields)).digest()


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (4 bytes per token), the form block hashes cover.

    Raises InvalidArgument if an id does not fit in int32 or is not an int.
    """
    try:
        # NOTE: struct.pack with an explicit "<" is both the fastest list -> bytes conversion we
        # measured (about 2x array('i') and numpy) and independent of the host's byte order.
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as e:
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or not -(2**31) <= t < 2**31:
                raise InvalidArgument(f"token_ids[{i}] = {t!r} is not an int32") from e
        raise InvalidArgument(f"token_ids cannot be packed as int32: {e}") from e


def hash_block(parent: BlockHash | None, token_ids: Sequence[int] | bytes, extra: bytes) -> BlockHash:
    """Hash of one block: sha256(parent or 32 zero bytes || extra || token ids as LE int32).

    ``token_ids`` may be a sequence of ints or the bytes of ``pack_token_ids``.
    """
    data = token_ids if isinstance(token_ids, bytes) else pack_token_ids(token_ids)
    return BlockHash(_sha256((parent or _ZERO_HASH) + extra + data).digest())


def hash_full_blocks(
    token_ids: Sequence[int] | bytes,
    block_size: int,
    extra: bytes,
    start_parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every FULL block of ``token_ids`` (a trailing partial block is ignored).

    ``token_ids`` is a sequence of ints or ``pack_token_ids`` bytes, starting at a block
    boundary; ``start_parent`` is the hash of the block just before it (None at token 0).
    Returns ``len(token_ids) // block_size`` hashes, in token order.
    """
    data = token_ids if isinstance(token_ids, bytes) else pack_token_ids(token_ids)
    step = 4 * block_size
    end = len(data) - len(data) % step
    parent = start_parent or _ZERO_HASH
    hashes: list[BlockHash] = []
    append = hashes.append
    sha256 = _sha256
    # NOTE: the token list is converted to bytes once; each block is a slice of it. The cost
    # per block is dominated by one sha256 call (OpenSSL's per-call setup), not by Python.
    for i in range(0, end, step):
        parent = sha256(parent + extra + data[i : i + step]).digest()
        append(parent)
    return hashes


@dataclass(slots=True)
class BlockStored:
    """A block entered the prefix index (its KV is written and committed)."""

    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    block_id: int
    token_ids: list[int]


@dataclass(slots=True)
class BlockRemoved:
    """A block left the prefix index (evicted to make room, or the cache was reset)."""

    block_hash: BlockHash
    block_id: int


class Block:
    """One pool slot's metadata. Also the node of the intrusive free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is referenced.
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """LRU queue of unreferenced blocks: an intrusive doubly linked list between two sentinels.

    The head is the least recently freed block (the next one allocation takes); freed blocks go
    to the tail. Removing a block from the middle (a prefix hit on a free cached block) is O(1),
    unlike ``deque.remove``. The links live on the blocks (``prev_free`` / ``next_free``; both
    None while referenced).

    NOTE: BlockManager edits the links inline in allocate / touch / free, fused with its own
    per-block work: these run once per block of every sequence, and a method call per block
    cost more than the list edit itself.
    """

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.num_free = len(blocks)
        prev = self.head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def block_ids(self) -> list[int]:
        """Block ids from head (evicted first) to tail. O(num_free): for tests and debugging."""
        ids = []
        block = self.head.next_free
        while block is not self.tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockManager:
    """Reference counts, the LRU free queue and the prefix index of a pool of ``num_blocks`` blocks.

    Units: blocks, except ``block_size`` (tokens per block). Every method is O(blocks touched);
    nothing scans the pool except ``check_invariants`` and ``reset_prefix_cache``.
    """

    def __init__(self, num_blocks: int, block_size: int, *, record_events: bool = True) -> None:
        if num_blocks <= 0:
            raise InvalidArgument(f"num_blocks = {num_blocks} must be > 0")
        if block_size <= 0:
            raise InvalidArgument(f"block_size = {block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: every Block object is created once, up front, and reused for the life of the
        # pool: no allocation (and no GC pressure) on the hot path.
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.prefix_index: dict[BlockHash, Block] = {}
        self.num_evictions = 0
        # Events for a global prefix index; the servicer drains them with take_events().
        self.record_events = record_events
        self._events: list[BlockStored | BlockRemoved] = []

    # ------------------------------------------------------------------ counters

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue, including cached-but-unreferenced ones."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_cnt > 0 (free xor referenced, so total - free)."""
        return self.num_blocks - self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks carrying a published hash, referenced or not."""
        return len(self.prefix_index)

    def ref_count(self, block_id: int) -> int:
        return self._block(block_id).ref_cnt

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash the block is published under, or None."""
        return self._block(block_id).block_hash

    def free_block_ids(self) -> list[int]:
        """Free queue from head (next to be allocated/evicted) to tail. O(num_free)."""
        return self.free_queue.block_ids()

    def _block(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidArgument(f"block_id = {block_id} is out of range [0, {self.num_blocks})")
        return self.blocks[block_id]

    # ------------------------------------------------------------------ lifecycle

    def cached_prefix(self, block_hashes: list[BlockHash]) -> list[int]:
        """Block ids of the longest leading run of ``block_hashes`` in the index. Read-only."""
        index = self.prefix_index
        hit: list[int] = []
        for h in block_hashes:
            block = index.get(h)
            if block is None:
                break
            hit.append(block.block_id)
        return hit

    def can_allocate(self, num_new_blocks: int, touched_block_ids: Iterable[int] = ()) -> bool:
        """Whether ``num_new_blocks`` can be allocated after touching ``touched_block_ids``.

        Touching a free (cached) block takes it out of the free queue, so it no longer counts.
        """
        blocks = self.blocks
        taken = {i for i in touched_block_ids if blocks[i].ref_cnt == 0}
        return num_new_blocks <= self.free_queue.num_free - len(taken)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each block (a prefix hit); a free block leaves the free queue."""
        blocks = self.blocks
        removed = 0
        for i in block_ids:
            block = blocks[i]
            if block.ref_cnt == 0:
                # Unlink from the middle of the free queue, O(1).
                prev, nxt = block.prev_free, block.next_free
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                removed += 1
            block.ref_cnt += 1
        self.free_queue.num_free -= removed

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the LRU head, each with ref_cnt 1.

        A popped block that still carries a hash is evicted from the prefix index now (a
        BlockRemoved event): cached blocks are only dropped when nothing else is free.
        Raises ResourceExhausted, changing nothing, if fewer than ``num_blocks`` are free.
        """
        if num_blocks < 0:
            raise InvalidArgument(f"num_blocks = {num_blocks} must be >= 0")
        queue = self.free_queue
        if num_blocks > queue.num_free:
            raise ResourceExhausted(
                f"need {num_blocks} blocks but only {queue.num_free} of {self.num_blocks} are free"
            )
        ids: list[int] = []
        append = ids.append
        index = self.prefix_index
        events = self._events if self.record_events else None
        evicted = 0
        # Pop from the head, one pass: unlink, evict if cached, take the reference.
        head = queue.head
        block = head.next_free
        for _ in range(num_blocks):
            block_hash = block.block_hash
            if block_hash is not None:
                del index[block_hash]
                block.block_hash = None
                evicted += 1
                if events is not None:
                    events.append(BlockRemoved(block_hash, block.block_id))
            block.ref_cnt = 1
            append(block.block_id)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        head.next_free = block
        block.prev_free = head
        queue.num_free -= num_blocks
        self.num_evictions += evicted
        return ids

    def free(self, block_ids: Sequence[int]) -> int:
        """Drop one reference per id, in the given order; blocks reaching 0 go to the queue tail.

        Callers pass a block table REVERSED, so the tail of a chain sits nearer the head of the
        queue and is evicted before its prefix. Returns how many blocks reached 0. Freeing a
        block with ref_cnt 0 raises InvalidArgument and changes nothing.
        """
        blocks = self.blocks
        queue = self.free_queue
        tail = queue.tail
        last = first_last = tail.prev_free
        released = 0
        # Blocks reaching 0 are linked behind the current tail as they come; the tail sentinel
        # is re-linked once at the end.
        for k, i in enumerate(block_ids):
            block = blocks[i]
            ref_cnt = block.ref_cnt
            if ref_cnt == 1:
                block.ref_cnt = 0
                last.next_free = block
                block.prev_free = last
                last = block
                released += 1
            elif ref_cnt > 1:
                block.ref_cnt = ref_cnt - 1
            else:
                # Undo: unlink what this call linked, restore the counts, then report.
                block = first_last.next_free if released else None
                for _ in range(released):
                    nxt = block.next_free
                    block.prev_free = block.next_free = None
                    block = nxt
                first_last.next_free = tail
                for j in block_ids[:k]:
                    blocks[j].ref_cnt += 1
                raise InvalidArgument(f"block_ids[{k}] = {i} is not referenced (ref_cnt 0)")
        last.next_free = tail
        tail.prev_free = last
        queue.num_free += released
        return released

    def publish(
        self,
        block_id: int,
        block_hash: BlockHash,
        parent_block_hash: BlockHash | None,
        token_ids: list[int],
    ) -> bool:
        """Enter a committed full block into the prefix index (a BlockStored event).

        Returns False and changes nothing if the block already carries a hash, or if another
        block is already published under ``block_hash`` (the first one stays; no duplicates).
        """
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.prefix_index:
            return False
        block.block_hash = block_hash
        self.prefix_index[block_hash] = block
        if self.record_events:
            self._events.append(BlockStored(block_hash, parent_block_hash, block_id, token_ids))
        return True

    def publish_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        token_ids: list[int],
    ) -> int:
        """``publish`` for blocks ``start..end-1`` of one chain, in one call.

        ``block_ids`` is a block table, ``block_hashes`` its chained hashes (at least ``end``)
        and ``token_ids`` the sequence's token list (at least ``end * block_size``). Block j is
        published under ``block_hashes[j]`` with parent ``block_hashes[j - 1]``. Returns how many
        blocks were newly published (duplicates and already-hashed blocks are skipped).
        """
        blocks = self.blocks
        index = self.prefix_index
        events = self._events if self.record_events else None
        bs = self.block_size
        count = 0
        parent = block_hashes[start - 1] if start else None
        offset = start * bs
        for block_id, block_hash in zip(block_ids[start:end], block_hashes[start:end], strict=True):
            block = blocks[block_id]
            if block.block_hash is None and block_hash not in index:
                block.block_hash = block_hash
                index[block_hash] = block
                count += 1
                if events is not None:
                    events.append(BlockStored(block_hash, parent, block_id, token_ids[offset : offset + bs]))
            parent = block_hash
            offset += bs
        return count

    def reset_prefix_cache(self) -> bool:
        """Drop every hash (BlockRemoved events) if no block is referenced; else False, no change."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block_hash, block in self.prefix_index.items():
            block.block_hash = None
            if self.record_events:
                self._events.append(BlockRemoved(block_hash, block.block_id))
        self.prefix_index.clear()
        return True

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """Return and clear the events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ checks

    def check_invariants(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Raise AssertionError naming the first broken invariant. O(num_blocks + table sizes).

        ``block_tables`` are every live block table; each holds one reference per entry.
        """
        holders = Counter(i for table in block_tables for i in table)
        for i in holders:
            assert 0 <= i < self.num_blocks, f"block table holds block id {i} outside [0, {self.num_blocks})"

        # Free queue: links consistent, every member unreferenced, no cycles.
        queue = self.free_queue
        seen: set[int] = set()
        prev, block = queue.head, queue.head.next_free
        while block is not queue.tail:
            assert block is not None, f"free queue broken after block {prev.block_id}"
            assert block.prev_free is prev, f"block {block.block_id}: prev_free is not block {prev.block_id}"
            assert block.block_id not in seen, f"block {block.block_id} appears twice in the free queue"
            assert block.ref_cnt == 0, (
                f"block {block.block_id} is in the free queue with ref_cnt {block.ref_cnt}"
            )
            seen.add(block.block_id)
            prev, block = block, block.next_free
        assert queue.tail.prev_free is prev, "free queue tail sentinel does not point at the last block"
        assert len(seen) == queue.num_free, (
            f"free queue holds {len(seen)} blocks, num_free says {queue.num_free}"
        )

        used = 0
        for block in self.blocks:
            in_queue = block.block_id in seen
            assert (block.ref_cnt == 0) == in_queue, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free_queue={in_queue} (must be free xor referenced)"
            )
            if not in_queue:
                assert block.prev_free is None and block.next_free is None, (
                    f"referenced block {block.block_id} still has free-queue links"
                )
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders.get(block.block_id, 0)} block tables hold it"
            )
            used += block.ref_cnt > 0
            if block.block_hash is not None:
                assert self.prefix_index.get(block.block_hash) is block, (
                    f"block {block.block_id} carries hash {block.block_hash.hex()[:16]} that the index does not map to it"
                )
        assert used + queue.num_free == self.num_blocks, (
            f"used {used} + free {queue.num_free} != total {self.num_blocks}"
        )
        for block_hash, block in self.prefix_index.items():
            assert block.block_hash == block_hash, (
                f"index maps hash {block_hash.hex()[:16]} to block {block.block_id}, which carries another hash"
            )
