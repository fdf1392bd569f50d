"""Physical KV blocks of the pool: reference counts, the LRU free queue and the prefix index.

No gRPC and no tensors here: block ids are plain ints naming pool slots (the same slot in every
layer). The per-sequence bookkeeping that drives this class lives in ``cachesvc.sequences``;
how blocks are named is specified in ``kvtier.block_hash``.

Prefix index
------------
The index is keyed by a block's hash preimage (``parent || token bytes``), not by the digest,
so walking a prompt's cached prefix costs a dict lookup per block instead of a SHA-256 call:
the parent of the next key is the hash already stored on the block that hit. SHA-256 runs only
for blocks published for the first time, to name them for the events and the next key. A
lookup compares the block's own tokens exactly; the prefix before it is known by the parent's
digest, so a wrong hit still takes a SHA-256 collision, exactly as with a digest-keyed index.

Lifecycle of a block
--------------------
free (in the LRU queue, maybe still cached) --allocate/touch--> referenced --commit--> published
in the prefix index (hash set) --free--> queue tail, still published; evicted from the index only
when ``allocate`` pops it from the queue head because no other block is free. A block freed
unpublished goes to the queue head instead: it is reused before any cached block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from kvtier.block_hash import (
    BlockHash,
    InvalidHashInput,
    chain_preimages,
    hash_preimage,
    iter_block_bytes,
    pack_token_ids,
)
from kvtier.cachesvc.errors import InvalidArgument, ResourceExhausted
from kvtier.cachesvc.events import REMOVED, STORED, BlockEvent, EventRecord, decode_events
from kvtier.cachesvc.free_queue import Block, FreeBlockQueue, OverFreed


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
        # Other blocks holding the same content as an indexed one (several requests committed
        # the same new prefix at once): preimage -> those blocks. Each carries the hash too and
        # takes the indexed block's place when that one is evicted, so the content stays
        # findable while any copy lives. Empty unless duplicates exist.
        self.copies: dict[bytes, list[Block]] = {}
        self.num_evictions = 0
        # Events for a global prefix index, as EventRecords; the servicer drains them with
        # take_event_records() after every call.
        self.record_events = record_events
        self._events: list[EventRecord] = []
        # Published blocks allocate evicted since the last take_evicted, collected only while
        # keep_evicted (tiers below the device, cachesvc.lower_tiers): their ids and index keys,
        # their KV still in the pool until the caller hands it down and their new owner writes.
        self.keep_evicted = False
        self.evicted_ids: list[int] = []
        self.evicted_keys: list[bytes] = []
        # Per block id: the tenant whose sequence published it ("" the default), for the shared tier.
        self.block_tenants: list[str] = [""] * num_blocks

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
        ids: list[int] = []
        hashes: list[BlockHash] = []
        parent = extra
        for (tokens,) in iter_block_bytes(data, self.block_size, max_blocks):
            block = index.get(parent + tokens)
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
        self.free_queue.acquire(self.blocks, block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the LRU head, each with ref_cnt 1.

        A popped block that still carries a hash is evicted now: an indexed block with a live
        copy hands its index entry to that copy (the hash stays stored: no event); otherwise
        the hash leaves the index (a BlockRemoved event). A copy just leaves its list. Cached
        blocks are only dropped when nothing else is free. Raises ResourceExhausted, changing
        nothing, if fewer than ``num_blocks`` are free.
        """
        if num_blocks < 0:
            raise InvalidArgument(f"num_blocks = {num_blocks} must be >= 0")
        queue = self.free_queue
        if num_blocks > queue.num_free:
            raise ResourceExhausted(
                f"need {num_blocks} blocks but only {queue.num_free} of {self.num_blocks} are free"
            )
        ids: list[int] = []
        cached = queue.pop_acquire_n(num_blocks, ids)
        if not cached:
            return ids
        index, copies = self.prefix_index, self.copies
        hashes: list[BlockHash] = []
        evicted: list[int] = []
        keys: list[bytes] = []  # their index keys, for take_evicted
        hook = self.keep_evicted  # keys are collected only for the tiers below
        # NOTE: one pass, inline (this runs for almost every allocation of a full pool); copies
        # are rare.
        for block in cached:
            key = block.index_key
            if copies and key in copies:
                self._drop_copy_or_promote(block, key)
            else:
                del index[key]
                hashes.append(block.block_hash)
                evicted.append(block.block_id)
                if hook:
                    keys.append(key)
            block.block_hash = block.index_key = None
        self.num_evictions += len(cached)
        if self.record_events and hashes:
            self._events.append((REMOVED, tuple(hashes), tuple(evicted)))
        if hook and evicted:
            self.evicted_ids += evicted
            self.evicted_keys += keys
        return ids

    def allocate_one(self) -> int:
        """``allocate(1)``'s block id, without its lists: the block Extend takes when a sequence
        crosses a block boundary (once per ``block_size`` decode steps of every sequence)."""
        queue = self.free_queue
        if not queue.num_free:
            self.allocate(1)  # raises ResourceExhausted
        block = queue.pop_acquire_one()
        key = block.index_key
        if key is None:
            return block.block_id
        # Evicted, as in allocate.
        block_id, block_hash = block.block_id, block.block_hash
        self.num_evictions += 1
        if self.copies and key in self.copies:
            self._drop_copy_or_promote(block, key)
            block.block_hash = block.index_key = None
            return block_id
        del self.prefix_index[key]
        block.block_hash = block.index_key = None
        if self.record_events:
            self._events.append((REMOVED, (block_hash,), (block_id,)))
        if self.keep_evicted:
            self.evicted_ids.append(block_id)
            self.evicted_keys.append(key)
        return block_id

    def take_evicted(self, with_tenants: bool = False) -> tuple[list, ...]:
        """The published blocks ``allocate`` evicted since the last call, while ``keep_evicted``:
        ``(block ids, index keys)``, oldest first, and with ``with_tenants`` their tenants. Their KV
        is still in the pool: the caller copies it down (``TierStack.keep``) before it returns the
        blocks to their new owner."""
        ids, keys = self.evicted_ids, self.evicted_keys
        self.evicted_ids, self.evicted_keys = [], []
        if with_tenants:
            tenants = self.block_tenants
            return ids, keys, [tenants[i] for i in ids]
        return ids, keys

    def _drop_copy_or_promote(self, block: Block, key: bytes) -> None:
        """``block`` carries content that other blocks hold too: if it is the indexed one, a copy
        takes its index entry; else it leaves the copies."""
        others = self.copies[key]
        if self.prefix_index[key] is block:
            self.prefix_index[key] = others.pop()
        else:
            others.remove(block)
        if not others:
            del self.copies[key]

    def free(self, block_ids: Sequence[int]) -> int:
        """Drop one reference per id, in the given order; return how many blocks reached 0.

        A block reaching 0 that is published goes to the queue tail (evicted last); one that
        is not (a partial tail block, a block never committed) goes to the head, to be reused
        before any cached block, as in vLLM. Callers pass a block table REVERSED, so the tail
        of a chain sits nearer the head of the queue and is evicted before its prefix. Freeing
        a block with ref_cnt 0 raises InvalidArgument and changes nothing.
        """
        try:
            return self.free_queue.release(self.blocks, block_ids)
        except OverFreed as e:
            raise InvalidArgument(str(e)) from None

    def publish(
        self,
        block_id: int,
        parent_block_hash: BlockHash | None,
        token_ids: list[int],
        extra: bytes,
        tenant: str = "",
    ) -> BlockHash | None:
        """Enter one committed full block into the prefix index (a BlockStored event).

        ``parent_block_hash`` is the previous block's hash (None for a sequence's first block),
        ``token_ids`` the block's ``block_size`` tokens. Returns the block's hash; None if the
        block already carries a hash (nothing changes) or another block is already published for
        the same chain: that one stays indexed and this one becomes its copy (``copies``), which
        takes its place if it is evicted first. No event for a copy.
        """
        if len(token_ids) != self.block_size:
            raise InvalidArgument(f"len(token_ids) = {len(token_ids)} is not block_size {self.block_size}")
        block = self.blocks[block_id]
        try:
            token_bytes = pack_token_ids(token_ids)
        except InvalidHashInput as e:
            raise InvalidArgument(str(e)) from None
        hashes: list[BlockHash] = []
        (key,) = chain_preimages(token_bytes, self.block_size, parent_block_hash or extra, hashes, 0)
        block_hash = hashes[0]
        if block.block_hash is not None:
            return None
        self.block_tenants[block_id] = tenant
        if key in self.prefix_index:
            self._add_copy(block, block_hash, key)
            return None
        block.block_hash, block.index_key = block_hash, key
        self.prefix_index[key] = block
        if self.record_events:
            self._events.append((STORED, (block_hash,), (block_id,), token_bytes, parent_block_hash, extra))
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
        tenant: str = "",
    ) -> int:
        """``publish`` for blocks ``start..end-1`` of one sequence, in one call.

        ``block_ids`` is its block table, ``token_ids`` its token list (at least ``end *
        block_size`` tokens), ``extra`` its extra key and ``block_hashes`` its chain of known
        hashes (at least ``start``); hashes missing up to ``end`` are computed and appended.
        ``packed`` may hold the leading tokens already as ``pack_token_ids`` bytes (the prompt):
        those are not converted again. Token ids must be valid int32 (the caller checked them);
        ``tenant`` publishes them (``block_tenants``).
        Returns how many blocks were newly published; already-hashed blocks are skipped and
        duplicates of published content become copies, as in ``publish``.
        """
        bs = self.block_size
        step = 4 * bs
        first_unpacked = min(max(start * bs, len(packed) // 4), end * bs)
        data = packed[start * step : first_unpacked * 4] + pack_token_ids(
            token_ids[first_unpacked : end * bs]
        )
        parent = block_hashes[start - 1] if start else extra
        preimages = chain_preimages(data, bs, parent, block_hashes, start)
        blocks = self.blocks
        index = self.prefix_index
        skipped: list[int] = []
        j = start
        tenants = self.block_tenants
        for key in preimages:
            block = blocks[block_ids[j]]
            if block.block_hash is None and key not in index:
                block.block_hash, block.index_key = block_hashes[j], key
                index[key] = block
                tenants[block_ids[j]] = tenant
            else:
                if block.block_hash is None:
                    self._add_copy(block, block_hashes[j], key)
                    tenants[block_ids[j]] = tenant
                skipped.append(j)
            j += 1
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
                            extra,
                        )
                    )
                run_start = j + 1
        return end - start - len(skipped)

    def _add_copy(self, block: Block, block_hash: BlockHash, key: bytes) -> None:
        """File ``block`` as another holder of the content indexed under ``key`` (no event:
        the hash is already stored)."""
        block.block_hash, block.index_key = block_hash, key
        self.copies.setdefault(key, []).append(block)

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
        for others in self.copies.values():
            for block in others:
                block.block_hash = block.index_key = None
        self.prefix_index.clear()
        self.copies.clear()
        return True

    def take_event_records(self) -> list[EventRecord]:
        """Return and clear the events recorded since the last call, oldest first, as EventRecords."""
        events, self._events = self._events, []
        return events

    def take_events(self) -> list[BlockEvent]:
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

        # Free queue: links consistent (the queue's own check), every member unreferenced.
        queue = self.free_queue
        seen: set[int] = set()
        for block in queue.check_links():
            assert block.ref_cnt == 0, (
                f"block {block.block_id} is in the free queue with ref_cnt {block.ref_cnt}"
            )
            seen.add(block.block_id)

        used = 0
        for block in self.blocks:
            in_queue = block.block_id in seen
            assert (block.ref_cnt == 0) == in_queue, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free_queue={in_queue} (must be free xor referenced)"
            )
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders.get(block.block_id, 0)} block tables hold it"
            )
            used += block.ref_cnt > 0
            assert (block.block_hash is None) == (block.index_key is None), (
                f"block {block.block_id}: block_hash and index_key must be set together"
            )
            if block.block_hash is not None:
                assert self.prefix_index.get(block.index_key) is block or block in self.copies.get(
                    block.index_key, ()
                ), (
                    f"block {block.block_id} carries hash {block.block_hash.hex()[:16]} that neither the "
                    "index nor its copies map to it"
                )
        assert used + queue.num_free == self.num_blocks, (
            f"used {used} + free {queue.num_free} != total {self.num_blocks}"
        )
        for key, others in self.copies.items():
            assert others and key in self.prefix_index, "a copies entry without an indexed block"
            for block in others:
                assert block.index_key == key and block is not self.prefix_index[key], (
                    f"block {block.block_id} is filed as a copy under a key it does not carry"
                )
        for key, block in self.prefix_index.items():
            assert block.index_key == key and block.block_hash == hash_preimage(key), (
                f"index maps a key to block {block.block_id}, which carries another key or hash"
            )
