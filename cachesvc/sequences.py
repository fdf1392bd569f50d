"""The table of live sequences and the batched operations the cache service's RPCs map onto.

Per sequence: token ids, block table, computed tokens and the tier its blocks are on (a
``records.Sequence``): what lets any replica continue any sequence. ``SequenceTable`` owns the
records and the lifecycle, composed of collaborators each testable alone: ``TenantLimits``,
``Fencing``, the tiers and ``Swapping``, and each call's checks (``validation``, ``allocation``).

Every batched method is all or nothing: (1) validate every item, (2) check capacity for the
whole batch, (3) mutate. Phases 1 and 2 touch no state (not LRU order, not stats), so a raised
CacheError leaves the table, the block manager and the tiers exactly as they were.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from kvtier.cachesvc import validation as checks
from kvtier.cachesvc.allocation import grow_one, lookup_tiers, plan_allocate, plan_extend, promote_lower_hits
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import NotFound, ResourceExhausted
from kvtier.cachesvc.fencing import Fencing
from kvtier.cachesvc.invariants import check_table
from kvtier.cachesvc.limits import TenantLimits
from kvtier.cachesvc.records import DEVICE, CacheStats, Sequence
from kvtier.cachesvc.releases import Releasing
from kvtier.cachesvc.swap import Swapping
from kvtier.cachesvc.tiers import DeviceTier
from kvtier.sequence_types import AllocateItem, CommitItem, ExtendItem, PrefixQuery, SequenceBlocks

if TYPE_CHECKING:
    from kvtier.cachesvc.host_area import HostArea
    from kvtier.cachesvc.lower_tiers import TierStack
    from kvtier.sequence_types import ReleaseItem


class SequenceTable:
    """All live sequences, keyed by id and by lease, over one block manager and swap tier.

    Units: tokens unless a name says blocks. Limits: ``vocab_size`` (token ids must be below it),
    ``max_model_len`` (tokens per sequence, lookahead included), ``max_batch`` (items per call).
    ``host_area``: the host area SwapOut copies to (the host cache's, or swap's own), or None;
    ``lower_tiers``: the tiers below the device (cachesvc.lower_tiers), or None. The quota
    arguments are ``TenantLimits``'; quotas and the fair share are checked before any block is
    taken.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        host_area: HostArea | None,
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
        lower_tiers: TierStack | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.model_fingerprint = model_fingerprint
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.stats = CacheStats()
        self._sequences: dict[int, Sequence] = {}
        self._by_lease: dict[str, dict[int, Sequence]] = {}
        self._next_sequence_id = 1
        self.extra_keys = checks.ExtraKeys(model_fingerprint)
        self.limits = TenantLimits(
            block_manager,
            self._sequences,
            max_blocks_per_tenant=max_blocks_per_tenant,
            tenant_quotas=tenant_quotas,
            max_blocks_per_lease=max_blocks_per_lease,
            fair_share=fair_share,
            fair_share_reserve=fair_share_reserve,
        )
        self.fencing = Fencing(block_manager)
        self.device = DeviceTier(block_manager, host_area.block_bytes if host_area is not None else 0)
        self.host_area = host_area
        self.swapping = Swapping(self.device, host_area, self.stats, lower_tiers)
        # The tiers below the device: the block manager returns the published blocks a call evicts,
        # handed down before it returns (Allocate: before promoting hits into fresh blocks).
        self.lower_tiers = lower_tiers
        block_manager.keep_evicted = lower_tiers is not None
        self.tiers = {DEVICE: self.device, **({host_area.name: host_area} if host_area is not None else {})}
        # Phase 1 of Commit over this table's records and bounds, bound once: it runs every decode
        # step. (Extend's growing path calls plan_extend: binding four bounds cost more there.)
        bounds = (self._sequences, self.block_size, max_model_len)
        self._check_commit = partial(checks.commit_sequences, *bounds, vocab_size, max_batch)
        self.releasing = Releasing(self._sequences, block_manager, self.limits, self.stats, max_batch)

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

    def lease_index(self) -> dict[str, dict[int, Sequence]]:
        return self._by_lease  # lease id -> its sequences by id (read only: for the invariants)

    @property
    def num_swapped_sequences(self) -> int:
        return sum(1 for s in self._sequences.values() if s.location != DEVICE)

    def room(self, block_table: list[int]) -> int:
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
        checks.check_batch(len(items), self.max_batch)
        plans, touched, total_new = plan_allocate(
            lease_id,
            items,
            self.block_manager,
            self.limits,
            self.extra_keys,
            self.vocab_size,
            self.max_model_len,
        )
        bm = self.block_manager
        if not bm.can_allocate(total_new, touched):
            self.limits.note_waiting({item.tenant for item in items})
            raise ResourceExhausted(
                f"allocate needs {total_new} new blocks for {len(items)} sequences but only "
                f"{bm.num_free_blocks - len({i for i in touched if bm.blocks[i].ref_cnt == 0})} of "
                f"{bm.num_blocks} blocks are free after prefix hits"
            )

        bm.touch(touched)
        new_ids = bm.allocate(total_new)
        if bm.evicted_ids:  # down the tiers before promotions write into new_ids
            self.lower_tiers.keep_evicted(bm)
        out: list[SequenceBlocks] = []
        stats = self.stats
        added = self.limits.added
        lease_seqs = self._by_lease.get(lease_id)  # created with its first sequence
        bs = self.block_size
        lower = self.lower_tiers
        pos = 0
        for item, plan in zip(items, plans, strict=True):
            hit = plan.hit
            table = hit + new_ids[pos : pos + plan.num_new_blocks]
            pos += plan.num_new_blocks
            num_cached = len(hit) * bs
            if lower is not None:
                num_cached += promote_lower_hits(lower, bm, plan, table, item.token_ids, item.tenant) * bs
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
                tier_slots=[],
                extra=plan.extra,
                prompt_bytes=plan.prompt_bytes,
                block_hashes=plan.block_hashes,
                request_id=item.request_id,
                tenant=item.tenant,
                room=min(len(table) * bs, self.max_model_len),  # room(), inline: once per sequence
                num_published_blocks=num_cached // bs,
            )
            self._sequences[sid] = seq
            if lease_seqs is None:
                lease_seqs = self._by_lease[lease_id] = {}
            lease_seqs[sid] = seq
            added(item.tenant, lease_id, len(table))
            stats.prefix_query_tokens += len(seq.token_ids)
            stats.prefix_hit_tokens += num_cached
            out.append(self._blocks_of(seq))
        if self.limits.waiting_tenants:
            self.limits.admitted([item.tenant for item in items])
        return out

    def extend(
        self,
        lease_id: str,
        items: list[ExtendItem],
        commits: list[CommitItem] = (),
        releases: list[ReleaseItem] = (),
    ) -> list[SequenceBlocks]:
        """Make room for ``num_tokens`` tokens beyond each sequence's current token count.

        New blocks only where a block boundary is crossed; a table never shrinks. ``commits`` are
        applied first, as ``commit`` would, then ``releases`` (``cachesvc.releases``); all or
        nothing (room is counted after the commits and before the releases free anything).
        """
        if len(items) == 1 and not commits and not releases:
            # NOTE: not a check (a miss takes the full path, which checks): once per decode step
            # of a sequence, the room is already there and nothing else needs doing. A subscript
            # in a try costs less than dict.get and a None test (CPython 3.11).
            sid, num_tokens = items[0]
            try:
                seq = self._sequences[sid]
            except KeyError:
                return self._extend(lease_id, items)  # raises NotFound
            if seq.lease_id == lease_id and 0 <= num_tokens <= seq.room - len(seq.token_ids):
                return [seq.cached_blocks or self._blocks_of(seq)]
            bm, limits = self.block_manager, self.limits
            if grow_one(seq, lease_id, num_tokens, bm, limits, self.max_model_len, self.lower_tiers):
                return [self._blocks_of(seq)]  # crossed a block boundary (cachesvc.allocation)
        elif commits or releases:
            checked = self._check_commit(lease_id, commits) if commits else []
            freeing = self.releasing.check(lease_id, releases, commits)
            self._extend(lease_id, items, {sid: len(new) for sid, new, _ in commits})  # checks only
            self._apply_commit(checked, commits)
            self.releasing.apply(freeing)
        return self._extend(lease_id, items)

    def _extend(
        self, lease_id: str, items: list[ExtendItem], pending: dict[int, int] | None = None
    ) -> list[SequenceBlocks]:
        """``extend``'s work. With ``pending`` (tokens a commit will append, per sequence id):
        check and count room as if they were appended, change nothing, return []."""
        seqs, grow, total_new = plan_extend(
            self._sequences, self.block_size, self.max_model_len, self.max_batch, lease_id, items, pending
        )
        limits = self.limits
        if total_new and (limits.limited or limits.contested()):
            more_by_tenant: dict[str, int] = {}
            for seq, more in grow:
                more_by_tenant[seq.tenant] = more_by_tenant.get(seq.tenant, 0) + more
            limits.check(lease_id, more_by_tenant, total_new)
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
            if bm.evicted_ids:
                self.lower_tiers.keep_evicted(bm)
            pos = 0
            for seq, more in grow:
                if limits.limited:
                    limits.charge(seq.tenant, lease_id, more)
                table = seq.block_table
                table += new_ids[pos : pos + more]
                pos += more
                seq.room = min(len(table) * self.block_size, self.max_model_len)  # room(), inline
                seq.cached_blocks = None
        if len(seqs) == 1:
            return [self._blocks_of(seqs[0])]
        blocks_of = self._blocks_of
        return [blocks_of(seq) for seq in seqs]

    def commit(self, lease_id: str, items: list[CommitItem]) -> int:
        """Append generated tokens and record written KV; publish newly complete full blocks.

        Per item ``(sequence_id, token_ids, num_computed_tokens)``: the token count after
        appending must fit the block table; ``num_computed_tokens`` never decreases and never
        exceeds the token count. Every full block inside ``num_computed_tokens`` enters the
        prefix index. Returns the number of blocks published by the call.
        """
        return self._apply_commit(self._check_commit(lease_id, items), items)

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
            seq.tenant,
        )
        seq.num_published_blocks = num_full_blocks
        return count

    def free(self, lease_id: str, sequence_ids: list[int], commits: list[CommitItem] = ()) -> int:
        """Drop sequences. Device blocks go to the LRU tail in reverse table order (still cached
        if committed); a swapped-out sequence releases its slots. Returns device blocks released.
        ``commits`` are applied first (a finished sequence's last tokens), all or nothing.
        """
        checked = self._check_commit(lease_id, commits) if commits else []
        if len(sequence_ids) > self.max_batch:
            checks.check_batch(len(sequence_ids), self.max_batch)
        seqs = [checks.owned(self._sequences, lease_id, k, sid, None) for k, sid in enumerate(sequence_ids)]
        if len(seqs) > 1:
            checks.check_unique(sequence_ids)
        if commits:
            self._apply_commit(checked, commits)
        if len(seqs) == 1:  # a finished request's Free
            return self._release(seqs[0])
        return sum(self._release(seq) for seq in seqs)

    def _release(self, seq: Sequence) -> int:
        """Drop one record and release its blocks on its tier; returns device blocks released."""
        limits = self.limits
        limits.released(seq.tenant, seq.lease_id, seq.num_blocks if limits.limited else 0)
        if seq.location == DEVICE:
            released = self.block_manager.free(seq.live_blocks[::-1])
        else:
            self.host_area.release(seq.tier_slots)
            released = 0
        del self._sequences[seq.sequence_id]
        lease_seqs = self._by_lease[seq.lease_id]
        del lease_seqs[seq.sequence_id]
        if not lease_seqs:
            del self._by_lease[seq.lease_id]
        return released

    def free_lease(self, lease_id: str, fence_until: float | None = None) -> int:
        """Release every sequence of a lease, on any tier (lease expiry). Committed blocks stay
        in the prefix cache, so a retry elsewhere hits them. Returns device blocks released; an
        unknown lease releases nothing.

        With ``fence_until``, a device sequence's blocks from the first one holding an
        uncommitted slot on are not released but handed to ``fencing`` until that time: a
        writer of the lease frozen inside a KV write can only finish it into them.
        """
        fenced: list[int] = []
        released = 0
        bs = self.block_size
        limits = self.limits
        for seq in self.sequences_of(lease_id):
            if fence_until is not None and seq.location == DEVICE:
                first_open = seq.num_computed_tokens // bs
                held = seq.block_table[first_open:]
                if held:  # charged to no tenant or lease while fenced
                    if limits.limited:
                        limits.charge(seq.tenant, seq.lease_id, -len(held))
                    seq.block_table = seq.block_table[:first_open]
                    fenced += held
            released += self._release(seq)
        if fenced:
            self.fencing.hold(fence_until, fenced, lease_id)
        return released

    def lookup_prefix(self, items: list[PrefixQuery], below: list | None = None) -> list[int]:
        """Per PrefixQuery ``(token_ids, tenant_salt, adapter_id)``: leading tokens cached on the
        device. Whole blocks only and NOT capped below the last token (a router wants the raw
        figure). Read-only: no reference taken, no LRU change, no stats. With lower tiers and a
        ``below`` list, per item the tokens per lower medium (``kvtier.media.LOWER_MEDIA`` order) of
        the chain past the device hit are appended to it (what Allocate would promote, uncapped).
        """
        keyed = checks.key_queries(
            items, self.extra_keys, self.vocab_size, self.max_model_len, self.max_batch
        )
        bm = self.block_manager
        if below is not None and self.lower_tiers is not None:
            return lookup_tiers(bm, self.lower_tiers, keyed, below)
        return [len(bm.match_prefix(data, extra, len(data))[0]) * self.block_size for data, extra in keyed]

    # ------------------------------------------------------------------ swapping

    def swap_out(
        self, lease_id: str, sequence_ids: list[int], commits: list[CommitItem] = ()
    ) -> tuple[int, int]:
        """Move whole sequences to the swap tier; their device blocks are freed (reverse order,
        committed ones stay cached). Returns ``(blocks, bytes)`` copied. ``commits`` are applied
        first (what the sequences computed since the last call), all or nothing.
        """
        checked = self._check_commit(lease_id, commits) if commits else []
        checks.check_batch(len(sequence_ids), self.max_batch)
        seqs = [checks.owned(self._sequences, lease_id, k, sid) for k, sid in enumerate(sequence_ids)]
        checks.check_unique(sequence_ids)
        self.swapping.check_out(sum(seq.num_blocks for seq in seqs))
        if commits:
            self._apply_commit(checked, commits)
        return self.swapping.move_out(seqs)

    def swap_in(self, lease_id: str, sequence_ids: list[int]) -> tuple[list[SequenceBlocks], int, int]:
        """Move swapped sequences back to fresh device blocks. Returns ``(blocks, num_blocks,
        num_bytes)``; ``blocks`` carry the new block tables. Committed full blocks are published again.
        """
        checks.check_batch(len(sequence_ids), self.max_batch)
        table, owned = self._sequences, checks.owned
        seqs = [owned(table, lease_id, k, sid, on_device=False) for k, sid in enumerate(sequence_ids)]
        checks.check_unique(sequence_ids)
        total = sum(len(seq.tier_slots) for seq in seqs)
        if self.limits.contested():  # the fair share: swapping in takes device blocks too
            by_tenant: dict[str, int] = {}
            for seq in seqs:
                by_tenant[seq.tenant] = by_tenant.get(seq.tenant, 0) + len(seq.tier_slots)
            self.limits.check_fair_share(by_tenant, total)
        self.swapping.check_in(total)

        total, num_bytes = self.swapping.move_in(seqs)
        for seq in seqs:
            seq.room = self.room(seq.block_table)
            seq.cached_blocks = None
            # Committed KV: to the index again (publish skips a duplicate of a still-cached original).
            seq.num_published_blocks = seq.num_released_blocks
            self._publish(seq, seq.num_computed_tokens // self.block_size)
        return [self._blocks_of(seq) for seq in seqs], total, num_bytes

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Block-manager, sequence, tenant and tier accounting (``cachesvc.invariants``)."""
        check_table(self)
