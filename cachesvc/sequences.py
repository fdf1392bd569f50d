"""The table of live sequences and the batched operations the cache service's RPCs map onto.

The cache service keeps, per sequence, its token ids, block table, computed tokens and where it
lives (device pool or host tier): a ``cachesvc.records.Sequence``. That is what lets compute be
stateless: any replica can continue any sequence from ``SequenceTable.get``.

Allocate, Extend, Commit, Free and LookupPrefix are here; SwapOut / SwapIn in ``cachesvc.swap``
(which the table inherits); the checks shared by all of them in ``cachesvc.validation``.

Every batched method is all or nothing. It runs in three phases:

1. validate every item (shape, ranges, existence, ownership, location, duplicates);
2. check capacity for the whole batch;
3. mutate.

Phases 1 and 2 touch no state (not LRU order, not stats), so a raised CacheError leaves the
table, the block manager and the host tier exactly as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachesvc.block_manager import BlockManager
from cachesvc.errors import InvalidArgument, NotFound, ResourceExhausted
from cachesvc.fencing import Fencing
from cachesvc.invariants import check_table
from cachesvc.limits import TenantLimits, count
from cachesvc.records import DEVICE, HOST, CacheStats, Sequence
from cachesvc.swap import Swapping
from cachesvc.validation import (
    ExtraKeys,
    check_batch,
    check_unique,
    owned,
    pack_checked,
    raise_allocate_error,
    raise_commit_error,
    raise_extend_error,
)
from kvtier.block_hash import BlockHash
from kvtier.sequence_types import AllocateItem, CommitItem, ExtendItem, PrefixQuery, SequenceBlocks

if TYPE_CHECKING:
    from cachesvc.host_tier import HostTier


@dataclass(slots=True)
class _AllocatePlan:
    """Phase-1 result of one allocate item, applied in phase 3."""

    block_hashes: list[BlockHash]
    hit: list[int]
    num_new_blocks: int
    extra: bytes
    prompt_bytes: bytes


class SequenceTable(TenantLimits, Fencing, Swapping):
    """All live sequences, keyed by id and by lease, over one block manager and host tier.

    Units: tokens unless a name says blocks. Limits: ``vocab_size`` (token ids must be below it),
    ``max_model_len`` (tokens per sequence, lookahead included), ``max_batch`` (items per call).

    Quotas and the fair share (``cachesvc.limits``, which the table inherits) are checked
    before any block is taken.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        host_tier: HostTier | None,
        *,
        model_fingerprint: str,
        vocab_size: int,
        max_model_len: int,
        max_batch: int = 1024,
        max_blocks_per_tenant: int = 0,
        tenant_quotas: dict[str, int] | None = None,
        max_blocks_per_lease: int = 0,
        fair_share: bool = True,
        fair_share_reserve: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.host_tier = host_tier
        self.block_size = block_manager.block_size
        self.model_fingerprint = model_fingerprint
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.stats = CacheStats()
        self._sequences: dict[int, Sequence] = {}
        self._by_lease: dict[str, dict[int, Sequence]] = {}
        self._next_sequence_id = 1
        self._extra_keys = ExtraKeys(model_fingerprint)
        self.fenced = []  # cachesvc.fencing
        self._init_limits(
            max_blocks_per_tenant, tenant_quotas, max_blocks_per_lease, fair_share, fair_share_reserve
        )

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._sequences)

    def get(self, sequence_id: int) -> Sequence:
        seq = self._sequences.get(sequence_id)
        if seq is None:
            raise NotFound(f"sequence_id = {sequence_id} is not a live sequence")
        return seq

    def sequences_of(self, lease_id: str) -> list[Sequence]:
        return list(self._by_lease.get(lease_id, {}).values())

    def sequences(self) -> list[Sequence]:
        return list(self._sequences.values())

    @property
    def num_swapped_sequences(self) -> int:
        return sum(1 for s in self._sequences.values() if s.location == HOST)

    def _room(self, block_table: list[int]) -> int:
        """``Sequence.room`` of a device sequence holding ``block_table``."""
        return min(len(block_table) * self.block_size, self.max_model_len)

    def _blocks_of(self, seq: Sequence) -> SequenceBlocks:
        blocks = seq.cached_blocks
        if blocks is None:
            table = seq.block_table
            blocks = SequenceBlocks(
                seq.sequence_id, list(table), seq.num_cached_tokens, len(table) * self.block_size
            )
            seq.cached_blocks = blocks
        return blocks

    # ------------------------------------------------------------------ lifecycle

    def allocate(self, lease_id: str, items: list[AllocateItem]) -> list[SequenceBlocks]:
        """New sequences: reuse each prompt's longest cached prefix, allocate blocks for the rest.

        A hit is whole blocks, capped so the last prompt token is always computed. Blocks cover
        ``len(token_ids) + num_lookahead_tokens`` tokens. Hits of ALL items are taken before any
        new block is allocated, so a later item's allocation never evicts an earlier item's hit.
        """
        check_batch(len(items), self.max_batch)
        bm = self.block_manager
        bs = self.block_size
        max_len = self.max_model_len
        plans: list[_AllocatePlan] = []
        touched: list[int] = []
        total_new = 0
        held_by_tenant: dict[str, int] = {}
        track = self._limited or self._contested()
        for k, item in enumerate(items):
            tokens = item.token_ids
            n = len(tokens)
            lookahead = item.num_lookahead_tokens
            if not (n >= 1 and lookahead >= 0 and n + lookahead <= max_len):
                raise_allocate_error(k, n, lookahead, max_len)
            where = f"items[{k}]"
            extra = self._extra_keys.get(where, item.tenant_salt, item.adapter_id)
            data = pack_checked(where, tokens, self.vocab_size)
            # Cap: the last prompt token is always computed (its logits are needed).
            hit, hashes = bm.match_prefix(data, extra, (n - 1) // bs)
            num_new = -(-(n + lookahead) // bs) - len(hit)
            if track or num_new + len(hit) > bm.num_blocks:
                self._check_fits(f"items[{k}]", item.tenant, num_new + len(hit))
                held_by_tenant[item.tenant] = held_by_tenant.get(item.tenant, 0) + num_new + len(hit)
            total_new += num_new
            touched += hit
            plans.append(_AllocatePlan(hashes, hit, num_new, extra, data))
        if track:
            self._check_limits(lease_id, held_by_tenant, sum(held_by_tenant.values()))
        if not bm.can_allocate(total_new, touched):
            self._note_waiting({item.tenant for item in items})
            raise ResourceExhausted(
                f"allocate needs {total_new} new blocks for {len(items)} sequences but only "
                f"{bm.num_free_blocks - len({i for i in touched if bm.blocks[i].ref_cnt == 0})} of "
                f"{bm.num_blocks} blocks are free after prefix hits"
            )

        bm.touch(touched)
        new_ids = bm.allocate(total_new)
        out: list[SequenceBlocks] = []
        stats = self.stats
        tenant_seqs = self.tenant_sequences
        limited = self._limited
        pos = 0
        for item, plan in zip(items, plans, strict=True):
            hit = plan.hit
            table = hit + new_ids[pos : pos + plan.num_new_blocks]
            pos += plan.num_new_blocks
            num_cached = len(hit) * bs
            sid = self._next_sequence_id
            self._next_sequence_id = sid + 1
            seq = Sequence(
                sequence_id=sid,
                lease_id=lease_id,
                token_ids=list(item.token_ids),
                block_table=table,
                num_computed_tokens=num_cached,
                num_cached_tokens=num_cached,
                location=DEVICE,
                host_slots=[],
                extra=plan.extra,
                prompt_bytes=plan.prompt_bytes,
                block_hashes=plan.block_hashes,
                request_id=item.request_id,
                tenant=item.tenant,
                room=min(len(table) * bs, max_len),  # _room, inline: once per sequence
                num_published_blocks=len(hit),
            )
            self._sequences[sid] = seq
            self._by_lease.setdefault(lease_id, {})[sid] = seq
            tenant_seqs[item.tenant] = tenant_seqs.get(item.tenant, 0) + 1
            if limited:
                self._charge(item.tenant, lease_id, len(table))
            stats.prefix_query_tokens += len(seq.token_ids)
            stats.prefix_hit_tokens += num_cached
            out.append(self._blocks_of(seq))
        if self.waiting_tenants:  # these tenants got blocks: they wait no more
            for item in items:
                self.waiting_tenants.pop(item.tenant, None)
        return out

    def extend(
        self, lease_id: str, items: list[ExtendItem], commits: list[CommitItem] = ()
    ) -> list[SequenceBlocks]:
        """Make room for ``num_tokens`` tokens beyond each sequence's current token count.

        New blocks only where a block boundary is crossed; a table never shrinks. ``commits``
        are applied first, as ``commit`` would; all or nothing: if either part is refused,
        neither is applied (room is counted from the token counts after the commits).
        """
        if len(items) == 1 and not commits:
            # Fast path, once per decode step of a sequence: room is already there.
            sid, num_tokens = items[0]
            seq = self._sequences.get(sid)
            if (
                seq is not None
                and seq.lease_id == lease_id
                and 0 <= num_tokens <= seq.room - len(seq.token_ids)
            ):
                return [seq.cached_blocks or self._blocks_of(seq)]
        elif commits:
            checked = self._check_commit(lease_id, commits)
            self._extend(lease_id, items, {sid: len(new) for sid, new, _ in commits})  # validates only
            self._apply_commit(checked, commits)
        return self._extend(lease_id, items)

    def _extend(
        self, lease_id: str, items: list[ExtendItem], pending: dict[int, int] | None = None
    ) -> list[SequenceBlocks]:
        """``extend``'s work. With ``pending`` (tokens a commit will append, per sequence id):
        validate and check room as if they were appended, change nothing, return []."""
        if len(items) > self.max_batch:
            check_batch(len(items), self.max_batch)
        sequences = self._sequences
        bs = self.block_size
        max_len = self.max_model_len
        seqs: list[Sequence] = []
        grow: list[tuple[Sequence, int]] = []  # (sequence, new blocks) of those crossing a boundary
        total_new = 0
        # NOTE: extend runs once per decode step per sequence, so validation is one combined
        # test per item; the slow path re-walks the batch to name the first bad item.
        for sid, num_tokens in items:
            seq = sequences.get(sid)
            if seq is None or seq.lease_id != lease_id or seq.location != DEVICE:
                raise_extend_error(self, lease_id, items)
            n = len(seq.token_ids) + (pending.get(sid, 0) if pending else 0)
            if not 0 <= num_tokens <= max_len - n:
                raise_extend_error(self, lease_id, items, pending)
            more = (n + num_tokens + bs - 1) // bs - len(seq.block_table)
            if more > 0:
                total_new += more
                grow.append((seq, more))
            seqs.append(seq)
        if len(items) > 1:
            check_unique([sid for sid, _ in items])
        if total_new and (self._limited or self._contested()):
            more_by_tenant: dict[str, int] = {}
            for seq, more in grow:
                more_by_tenant[seq.tenant] = more_by_tenant.get(seq.tenant, 0) + more
            self._check_limits(lease_id, more_by_tenant, total_new)
        bm = self.block_manager
        free = bm.num_free_blocks
        if total_new > free:
            raise ResourceExhausted(
                f"extend needs {total_new} new blocks but only {free} of {bm.num_blocks} are free"
            )
        if pending is not None:
            return []

        if total_new:
            new_ids = bm.allocate(total_new)
            pos = 0
            limited = self._limited
            for seq, more in grow:
                if limited:
                    self._charge(seq.tenant, lease_id, more)
                table = seq.block_table
                table += new_ids[pos : pos + more]
                pos += more
                seq.room = min(len(table) * bs, max_len)  # _room, inline: every growing Extend
                seq.cached_blocks = None
        if len(seqs) == 1:
            return [self._blocks_of(seqs[0])]
        blocks_of = self._blocks_of
        return [blocks_of(seq) for seq in seqs]

    def commit(self, lease_id: str, items: list[CommitItem]) -> int:
        """Append generated tokens and record written KV; publish newly complete full blocks.

        Per item ``(sequence_id, new_token_ids, num_computed_tokens)``: the token count after
        appending must fit the block table; ``num_computed_tokens`` never decreases and never
        exceeds the token count. Every full block inside ``num_computed_tokens`` enters the
        prefix index. Returns the number of blocks published by the call.
        """
        return self._apply_commit(self._check_commit(lease_id, items), items)

    def _check_commit(self, lease_id: str, items: list[CommitItem]) -> list[Sequence]:
        """``commit``'s validation (it reads, never writes): the items' sequences, in order."""
        if len(items) > self.max_batch:
            check_batch(len(items), self.max_batch)
        sequences = self._sequences
        bs = self.block_size
        max_len = self.max_model_len
        vocab = self.vocab_size
        seqs: list[Sequence] = []
        for sid, new_tokens, num_computed in items:
            seq = sequences.get(sid)
            if seq is None or seq.lease_id != lease_id or seq.location != DEVICE:
                raise_commit_error(self, lease_id, items)
            n = len(seq.token_ids) + len(new_tokens)
            if (
                n > len(seq.block_table) * bs
                or n > max_len
                or not seq.num_computed_tokens <= num_computed <= n
            ):
                raise_commit_error(self, lease_id, items)
            # A decode step commits a token or a few: a Python loop beats packing for those.
            if len(new_tokens) > 32:
                pack_checked(f"items[{len(seqs)}]", new_tokens, vocab)
            else:
                for t in new_tokens:
                    if type(t) is not int or not 0 <= t < vocab:
                        pack_checked(f"items[{len(seqs)}]", new_tokens, vocab)
                        break
            seqs.append(seq)
        if len(items) > 1:
            check_unique([item[0] for item in items])
        return seqs

    def _apply_commit(self, seqs: list[Sequence], items: list[CommitItem]) -> int:
        """``commit``'s changes, after ``_check_commit`` passed; returns blocks published."""
        bs = self.block_size
        published = 0
        for seq, (_, new_tokens, num_computed) in zip(seqs, items, strict=True):
            if new_tokens:
                seq.token_ids += new_tokens
            seq.num_computed_tokens = num_computed
            full = num_computed // bs
            if full > seq.num_published_blocks:
                published += self._publish(seq, full)
        return published

    def _publish(self, seq: Sequence, num_full_blocks: int) -> int:
        """Offer blocks [num_published_blocks, num_full_blocks) of ``seq`` to the prefix index."""
        count = self.block_manager.publish_blocks(
            seq.block_table,
            seq.block_hashes,
            seq.num_published_blocks,
            num_full_blocks,
            seq.token_ids,
            seq.extra,
            seq.prompt_bytes,
        )
        seq.num_published_blocks = num_full_blocks
        return count

    def free(self, lease_id: str, sequence_ids: list[int], commits: list[CommitItem] = ()) -> int:
        """Drop sequences. Device blocks go to the LRU tail in reverse table order (still cached
        if committed); a swapped-out sequence releases its host slots. Returns device blocks released.
        ``commits`` are applied first (a finished sequence's last tokens), all or nothing.
        """
        checked = self._check_commit(lease_id, commits) if commits else []
        if len(sequence_ids) > self.max_batch:
            check_batch(len(sequence_ids), self.max_batch)
        seqs = [owned(self._sequences, lease_id, k, sid, location=None) for k, sid in enumerate(sequence_ids)]
        if len(seqs) > 1:
            check_unique(sequence_ids)
        if commits:
            self._apply_commit(checked, commits)
        if len(seqs) == 1:  # a finished request's Free
            return self._release(seqs[0])
        return sum(self._release(seq) for seq in seqs)

    def _release(self, seq: Sequence) -> int:
        tenant = seq.tenant
        if self._limited:
            self._charge(tenant, seq.lease_id, -seq.num_blocks)
        count(self.tenant_sequences, tenant, -1)
        if seq.location == DEVICE:
            released = self.block_manager.free(seq.block_table[::-1])
        else:
            self.host_tier.release(seq.host_slots)
            released = 0
        del self._sequences[seq.sequence_id]
        lease_seqs = self._by_lease[seq.lease_id]
        del lease_seqs[seq.sequence_id]
        if not lease_seqs:
            del self._by_lease[seq.lease_id]
        return released

    def lookup_prefix(self, items: list[PrefixQuery]) -> list[int]:
        """Per PrefixQuery ``(token_ids, tenant_salt, adapter_id)``: leading tokens cached on the device.

        Whole blocks only and NOT capped below the last token (a router wants the raw figure).
        Read-only: no reference taken, no LRU change, no stats.
        """
        check_batch(len(items), self.max_batch)
        keyed: list[tuple[bytes, bytes]] = []
        for k, (tokens, tenant_salt, adapter_id) in enumerate(items):
            if len(tokens) > self.max_model_len:
                raise InvalidArgument(
                    f"items[{k}]: len(token_ids) = {len(tokens)} exceeds max_model_len {self.max_model_len}"
                )
            data = pack_checked(f"items[{k}]", tokens, self.vocab_size)
            extra = self._extra_keys.get(f"items[{k}]", tenant_salt, adapter_id)
            keyed.append((data, extra))
        bm = self.block_manager
        bs = self.block_size
        return [len(bm.match_prefix(data, extra, len(data))[0]) * bs for data, extra in keyed]

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Block-manager invariants over all device tables, plus sequence, tenant and host-tier
        accounting (``cachesvc.invariants``)."""
        check_table(self)
