"""Physical KV blocks of the pool: reference counts, the LRU free queue and the prefix index.

No gRPC and no tensors here: block ids are plain ints naming pool slots (the same slot in every
layer). The per-sequence bookkeeping that drives this class lives in ``cachesvc.sequences``.

Block hashes
------------
A full block (``block_size`` tokens) is named by a hash chained over every token before it:

    extra      = sha256(b"kvtier-block-v1\\0" + b"\\0".join(utf8(model_fingerprint), utf8(cache_salt), utf8(adapter_id)))
    block_hash = sha256(parent || token ids of the block as little-endian int32)

``parent`` is the previous block's hash, or ``extra`` for the first block of a sequence: the
model, tenant salt and adapter enter once, at the root of the chain, and every later hash
inherits them. Both are 32 bytes, so one preimage is 32 + 4 * block_size bytes (96 at block
size 16, two SHA-256 compressions). The formula depends on nothing in the process (no
``PYTHONHASHSEED``, no random seed), so a global prefix index elsewhere, fed by the
``BlockStored`` / ``BlockRemoved`` events, computes the same hashes from the same token ids.
Different salts, adapters or models never share a block because their chains start apart.

The prefix index is keyed by a block's hash preimage (``parent || token bytes``), not by the
digest, so walking a prompt's cached prefix costs a dict lookup per block instead of a SHA-256
call: the parent of the next key is the hash already stored on the block that hit. SHA-256 runs
only for blocks published for the first time, to name them for the events and the next key. A
lookup compares the block's own tokens exactly; the prefix before it is known by the parent's
digest, so a wrong hit still takes a SHA-256 collision, exactly as with a digest-keyed index.

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
    """Hash of one block: sha256((parent, or extra for the first block) || token ids as LE int32).

    ``token_ids`` may be a sequence of ints or the bytes of ``pack_token_ids``.
    """
    data = token_ids if isinstance(token_ids, bytes) else pack_token_ids(token_ids)
    return BlockHash(_sha256((parent or extra) + data).digest())


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
    parent = start_parent or extra
    hashes: list[BlockHash] = []
    append = hashes.append
    sha256 = _sha256
    # NOTE: the token list is converted to bytes once; each block is a slice of it. The cost
    # per block is dominated by one sha256 call (OpenSSL's per-call setup), not by Python.
    for i in range(0, end, step):
        parent = sha256(parent + data[i : i + step]).digest()
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


REMOVED = 0
STORED = 1

EventRecord = tuple
"""How the block manager records events on its hot path, without an object per block:

- ``(REMOVED, hashes, block_ids)``: a BlockRemoved per entry of the two tuples.
- ``(STORED, hashes, block_ids, token_bytes, parent)``: a BlockStored per entry of the tuples
  ``hashes`` and ``block_ids``, a run of consecutive blocks of one chain; block i's token ids
  are block i of ``token_bytes`` (``pack_token_ids`` form), its parent ``parent`` for i == 0
  and ``hashes[i - 1]`` after.

A commit costs one STORED record, an allocation that evicts one REMOVED record. Records hold
only tuples, bytes, ints and None, so the garbage collector stops tracking them: a log of
thousands of them costs no GC time.
"""


def num_events(record: EventRecord) -> int:
    """How many events an EventRecord stands for."""
    return len(record[1])


def decode_events(record: EventRecord, block_size: int) -> list[BlockStored | BlockRemoved]:
    """The ``BlockStored`` / ``BlockRemoved`` events an ``EventRecord`` stands for, in order."""
    if record[0] == REMOVED:
        return [BlockRemoved(h, i) for h, i in zip(record[1], record[2], strict=True)]
    _, hashes, block_ids, token_bytes, parent = record
    fmt = f"<{block_size}i"
    events: list[BlockStored | BlockRemoved] = []
    for i, (block_hash, block_id) in enumerate(zip(hashes, block_ids, strict=True)):
        tokens = list(struct.unpack_from(fmt, token_bytes, 4 * block_size * i))
        events.append(BlockStored(block_hash, parent, block_id, tokens))
        parent = block_hash
    return events


class Block:
    """One pool slot's metadata. Also the node of the intrusive free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "index_key", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # The preimage the prefix index files this block under; None exactly when block_hash is.
        self.index_key: bytes | None = None
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
        # Hash preimage (parent || token bytes) -> published block. See the module docstring.
        self.prefix_index: dict[bytes, Block] = {}
        self.num_evictions = 0
        # Events for a global prefix index, as EventRecords; the servicer drains them with
        # take_event_records() after every call.
        self.record_events = record_events
        self._events: list[EventRecord] = []

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

    def match_prefix(self, data: bytes, extra: bytes, max_blocks: int) -> tuple[list[int], list[BlockHash]]:
        """The longest leading run of published blocks matching a token sequence. Read-only.

        ``data`` is ``pack_token_ids`` of the tokens (from token 0), ``extra`` their extra key;
        at most ``max_blocks`` full blocks are matched. Returns the hit block ids and their hashes.
        """
        index = self.prefix_index
        step = 4 * self.block_size
        ids: list[int] = []
        hashes: list[BlockHash] = []
        parent = extra
        end = min(max_blocks, len(data) // step) * step
        for offset in range(0, end, step):
            block = index.get(parent + data[offset : offset + step])
            if block is None:
                break
            ids.append(block.block_id)
            parent = block.block_hash
            hashes.append(parent)
        return ids, hashes

    def can_allocate(self, num_new_blocks: int, touched_block_ids: Sequence[int] = ()) -> bool:
        """Whether ``num_new_blocks`` can be allocated after touching ``touched_block_ids``.

        Touching a free (cached) block takes it out of the free queue, so it no longer counts.
        """
        num_free = self.free_queue.num_free
        if num_new_blocks + len(touched_block_ids) <= num_free:
            return True  # enough even if every touched block were taken from the queue
        blocks = self.blocks
        taken = {i for i in touched_block_ids if blocks[i].ref_cnt == 0}
        return num_new_blocks <= num_free - len(taken)

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
        evicted_hashes: list[BlockHash] = []
        evicted_ids: list[int] = []
        # Pop from the head, one pass: unlink, evict if cached, take the reference.
        head = queue.head
        block = head.next_free
        for _ in range(num_blocks):
            block_hash = block.block_hash
            if block_hash is not None:
                del index[block.index_key]
                block.block_hash = block.index_key = None
                evicted_hashes.append(block_hash)
                evicted_ids.append(block.block_id)
            block.ref_cnt = 1
            append(block.block_id)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        head.next_free = block
        block.prev_free = head
        queue.num_free -= num_blocks
        if evicted_hashes:
            self.num_evictions += len(evicted_hashes)
            if self.record_events:
                self._events.append((REMOVED, tuple(evicted_hashes), tuple(evicted_ids)))
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
        self, block_id: int, parent_block_hash: BlockHash | None, token_ids: list[int], extra: bytes
    ) -> BlockHash | None:
        """Enter one committed full block into the prefix index (a BlockStored event).

        ``parent_block_hash`` is the previous block's hash (None for a sequence's first block),
        ``token_ids`` the block's ``block_size`` tokens. Returns the block's
        hash, or None and changes nothing if the block already carries a hash or another block
        is already published for the same chain (the first one stays; no duplicates).
        """
        if len(token_ids) != self.block_size:
            raise InvalidArgument(f"len(token_ids) = {len(token_ids)} is not block_size {self.block_size}")
        block = self.blocks[block_id]
        key = (parent_block_hash or extra) + pack_token_ids(token_ids)
        if block.block_hash is not None or key in self.prefix_index:
            return None
        block_hash = BlockHash(_sha256(key).digest())
        block.block_hash, block.index_key = block_hash, key
        self.prefix_index[key] = block
        if self.record_events:
            token_bytes = key[len(key) - 4 * self.block_size :]
            self._events.append((STORED, (block_hash,), (block_id,), token_bytes, parent_block_hash))
        return block_hash

    def publish_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: list[BlockHash],
        start: int,
        end: int,
        token_ids: list[int],
        extra: bytes,
        packed: bytes = b"",
    ) -> int:
        """``publish`` for blocks ``start..end-1`` of one sequence, in one call.

        ``block_ids`` is its block table, ``token_ids`` its token list (at least ``end *
        block_size`` tokens), ``extra`` its extra key and ``block_hashes`` its chain of known
        hashes (at least ``start``); hashes missing up to ``end`` are computed and appended.
        ``packed`` may hold the leading tokens already as ``pack_token_ids`` bytes (the prompt):
        those are not converted again.
        Returns how many blocks were newly published (duplicates and already-hashed blocks are
        skipped).
        """
        bs = self.block_size
        step = 4 * bs
        first_unpacked = min(max(start * bs, len(packed) // 4), end * bs)
        data = packed[start * step : first_unpacked * 4] + pack_token_ids(
            token_ids[first_unpacked : end * bs]
        )
        known = len(block_hashes)
        blocks = self.blocks
        index = self.prefix_index
        sha256 = _sha256
        skipped: list[int] = []
        parent = block_hashes[start - 1] if start else extra
        offset = 0
        for j in range(start, end):
            key = parent + data[offset : offset + step]
            offset += step
            if j < known:
                parent = block_hashes[j]
            else:
                parent = sha256(key).digest()
                block_hashes.append(parent)
            block = blocks[block_ids[j]]
            if block.block_hash is None and key not in index:
                block.block_hash, block.index_key = parent, key
                index[key] = block
            else:
                skipped.append(j)
        if self.record_events:
            # One record per run of published blocks: the whole range unless a block was skipped.
            run_start = start
            for j in [*skipped, end]:
                if j > run_start:
                    self._events.append(
                        (
                            STORED,
                            tuple(block_hashes[run_start:j]),
                            tuple(block_ids[run_start:j]),
                            data[(run_start - start) * step : (j - start) * step],
                            block_hashes[run_start - 1] if run_start else None,
                        )
                    )
                run_start = j + 1
        return end - start - len(skipped)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash (BlockRemoved events) if no block is referenced; else False, no change."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        blocks = list(self.prefix_index.values())
        if self.record_events and blocks:
            hashes = tuple(b.block_hash for b in blocks)
            self._events.append((REMOVED, hashes, tuple(b.block_id for b in blocks)))
        for block in blocks:
            block.block_hash = block.index_key = None
        self.prefix_index.clear()
        return True

    def take_event_records(self) -> list[EventRecord]:
        """Return and clear the events recorded since the last call, oldest first, as EventRecords."""
        events, self._events = self._events, []
        return events

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """``take_event_records``, decoded into event objects."""
        bs = self.block_size
        return [event for record in self.take_event_records() for event in decode_events(record, bs)]

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
            assert (block.block_hash is None) == (block.index_key is None), (
                f"block {block.block_id}: block_hash and index_key must be set together"
            )
            if block.block_hash is not None:
                assert self.prefix_index.get(block.index_key) is block, (
                    f"block {block.block_id} carries hash {block.block_hash.hex()[:16]} that the index does not map to it"
                )
        assert used + queue.num_free == self.num_blocks, (
            f"used {used} + free {queue.num_free} != total {self.num_blocks}"
        )
        for key, block in self.prefix_index.items():
            assert block.index_key == key and block.block_hash == _sha256(key).digest(), (
                f"index maps a key to block {block.block_id}, which carries another key or hash"
            )
