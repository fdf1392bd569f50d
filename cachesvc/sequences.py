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

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachesvc.block_manager import BlockManager
from cachesvc.errors import ExceedsLimit, InvalidArgument, NotFound, ResourceExhausted
from cachesvc.records import DEVICE, HOST, AllocateItem, CacheStats, Sequence, SequenceBlocks
from cachesvc.swap import Swapping
from cachesvc.validation import ExtraKeys, check_batch, check_unique, owned, pack_checked
from kvtier.block_hash import BlockHash, pack_token_ids

if TYPE_CHECKING:
    from cachesvc.host_tier import HostTier


# A tenant refused an Allocate for lack of free blocks while another tenant holds blocks counts
# as waiting this long (its replica retries admission every step, so one still waiting is seen
# again), or until an Allocate of its own succeeds.
FAIR_SHARE_WAIT_S = 2.0


def fair_shares(total: int, quotas: dict[str, int]) -> dict[str, int]:
    """Max-min fair split of ``total`` blocks among tenants, each capped by its quota (0 = none).

    Tenants whose quota is below an even split keep their quota and leave the rest to the
    others: ``fair_shares(100, {"a": 10, "b": 0, "c": 0}) == {"a": 10, "b": 45, "c": 45}``.
    """
    shares: dict[str, int] = {}
    left = total
    order = sorted(quotas, key=lambda t: (quotas[t] or total + 1, t))
    for i, tenant in enumerate(order):
        even = left // (len(order) - i)
        quota = quotas[tenant]
        shares[tenant] = min(quota, even) if quota else even
        left -= shares[tenant]
    return shares


@dataclass(slots=True)
class _AllocatePlan:
    """Phase-1 result of one allocate item, applied in phase 3."""

    block_hashes: list[BlockHash]
    hit: list[int]
    num_new_blocks: int
    extra: bytes
    prompt_bytes: bytes


class SequenceTable(Swapping):
    """All live sequences, keyed by id and by lease, over one block manager and host tier.

    Units: tokens unless a name says blocks. Limits: ``vocab_size`` (token ids must be below it),
    ``max_model_len`` (tokens per sequence, lookahead included), ``max_batch`` (items per call).

    Quotas (0 = none): ``max_blocks_per_tenant`` (a tenant's default), ``tenant_quotas`` (per
    tenant, over the default) and ``max_blocks_per_lease``. A tenant's or lease's blocks are the
    blocks its live sequences hold on either tier (``Sequence.num_blocks``; a prefix block two of
    them share counts for each holder), so swapping never changes them. Allocate and Extend
    refuse growth past a quota with ResourceExhausted (the caller waits or preempts); an
    Allocate item that alone exceeds a quota or the pool gets ExceedsLimit (it never fits).

    Fair share (``fair_share``, on by default; nothing to do while fewer than two tenants
    compete): the tenants competing are those holding blocks and those waiting (refused an
    Allocate for lack of free blocks in the last ``FAIR_SHARE_WAIT_S``). Under pressure (a call
    would leave fewer than ``fair_share_reserve`` blocks free, or another tenant is waiting), a
    tenant that already holds its share of device blocks (``fair_shares`` of the
    pool, quotas as caps) is refused more with ResourceExhausted naming the share, so its
    replica waits or preempts; a tenant under its share is never refused for this (one call may
    take it past the share).
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
        # Fencing: blocks of expired leases that a frozen writer could still be writing, held
        # (still referenced) until a deadline; (release time on the caller's clock, block ids,
        # lease id), oldest first. See ``free_lease``.
        self.fenced: list[tuple[float, list[int], str]] = []
        self.max_blocks_per_tenant = max_blocks_per_tenant
        self.tenant_quotas = dict(tenant_quotas or {})
        self.max_blocks_per_lease = max_blocks_per_lease
        self._limited = bool(max_blocks_per_tenant or self.tenant_quotas or max_blocks_per_lease)
        # Blocks held (either tier) per tenant and per lease; a key leaves when it reaches 0.
        self.tenant_blocks: dict[str, int] = {}
        self.lease_blocks: dict[str, int] = {}
        self.fair_share = fair_share
        self.fair_share_reserve = fair_share_reserve
        # Waiting tenants (refused an Allocate for lack of blocks) -> monotonic time of refusal.
        self.waiting_tenants: dict[str, float] = {}

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

    # ------------------------------------------------------------------ quotas

    def tenant_quota(self, tenant: str) -> int:
        """Most blocks ``tenant`` may hold; 0 = no limit."""
        return self.tenant_quotas.get(tenant, self.max_blocks_per_tenant)

    def _charge(self, tenant: str, lease_id: str, blocks: int) -> None:
        """Count ``blocks`` (negative: released) against a tenant and a lease."""
        if not blocks:
            return
        # NOTE: unrolled (every allocate, growing extend and free runs this).
        counts = self.tenant_blocks
        left = counts.get(tenant, 0) + blocks
        if left:
            counts[tenant] = left
        else:
            del counts[tenant]
        counts = self.lease_blocks
        left = counts.get(lease_id, 0) + blocks
        if left:
            counts[lease_id] = left
        else:
            del counts[lease_id]

    def _check_fits(self, where: str, tenant: str, blocks: int) -> None:
        """ExceedsLimit if one sequence of ``blocks`` blocks can never be held."""
        limits = (
            (self.block_manager.num_blocks, "the whole pool holds"),
            (self.tenant_quota(tenant), f"tenant {tenant!r} may hold (its quota)"),
            (self.max_blocks_per_lease, "one lease may hold (--max-blocks-per-lease)"),
        )
        for limit, what in limits:
            if limit and blocks > limit:
                raise ExceedsLimit(
                    f"{where} needs {blocks} blocks but {what} {limit} blocks: it can never fit; "
                    "shorten the prompt or max_tokens"
                )

    def _check_quotas(self, lease_id: str, more_by_tenant: dict[str, int], more: int) -> None:
        """ResourceExhausted if ``more`` new blocks of a call would take its lease or a tenant
        past a quota (they would fit once the holder's own sequences finish)."""
        limit = self.max_blocks_per_lease
        if limit and more:
            held = self.lease_blocks.get(lease_id, 0)
            if held + more > limit:
                raise ResourceExhausted(
                    f"lease {lease_id[:8]}… holds {held} of the {limit} blocks one lease may hold "
                    f"(--max-blocks-per-lease); this call needs {more} more"
                )
        for tenant, want in more_by_tenant.items():
            quota = self.tenant_quota(tenant)
            held = self.tenant_blocks.get(tenant, 0)
            if quota and want and held + want > quota:
                raise ResourceExhausted(
                    f"tenant {tenant!r} holds {held} of its {quota}-block quota; this call needs {want} more"
                )

    def _contested(self) -> bool:
        """Whether a call must count blocks per tenant for the fair share (cheap: no tenants,
        no work)."""
        return self.fair_share and (len(self.tenant_blocks) > 1 or bool(self.waiting_tenants))

    def _check_limits(self, lease_id: str, more_by_tenant: dict[str, int], more: int) -> None:
        """Quotas, then the fair share, for ``more`` new blocks of a call."""
        if self._limited:
            self._check_quotas(lease_id, more_by_tenant, more)
        if self.fair_share:
            self._check_fair_share(more_by_tenant, more)

    def _note_waiting(self, tenants: set[str]) -> None:
        """Tenants refused for lack of free blocks while another tenant holds blocks wait."""
        held = self.tenant_blocks
        if self.fair_share and held:
            now = time.monotonic()
            for tenant in tenants:
                if len(held) > 1 or tenant not in held:
                    self.waiting_tenants[tenant] = now

    def _check_fair_share(self, more_by_tenant: dict[str, int], more: int) -> None:
        """ResourceExhausted if, under pressure, a tenant of the call that holds its fair share
        of device blocks or more would take more (see the class docstring)."""
        waiting = self.waiting_tenants
        if waiting:
            cutoff = time.monotonic() - FAIR_SHARE_WAIT_S
            for tenant in [t for t, since in waiting.items() if since < cutoff]:
                del waiting[tenant]
        competing = set(self.tenant_blocks) | set(waiting) | {t for t, n in more_by_tenant.items() if n}
        if len(competing) < 2:
            return
        bm = self.block_manager
        free = bm.num_free_blocks
        others_waiting = [t for t in waiting if t not in more_by_tenant]
        if not others_waiting and free - more >= self.fair_share_reserve:
            return
        shares = fair_shares(bm.num_blocks, {t: self.tenant_quota(t) for t in competing})
        held = dict.fromkeys(more_by_tenant, 0)
        for seq in self._sequences.values():
            if seq.tenant in held:
                held[seq.tenant] += len(seq.block_table)
        for tenant, want in more_by_tenant.items():
            if want and held[tenant] >= shares[tenant]:
                why = (
                    f"tenant {others_waiting[0]!r} is waiting for blocks"
                    if others_waiting
                    else f"{free} of {bm.num_blocks} blocks are free"
                )
                raise ResourceExhausted(
                    f"tenant {tenant!r} holds {held[tenant]} device blocks, at or over its fair share "
                    f"of {shares[tenant]} blocks ({bm.num_blocks} among {len(competing)} tenants), "
                    f"and the pool is under pressure ({why}); this call needs {want} more"
                )

    def tenant_usage(self) -> dict[str, tuple[int, int, int]]:
        """Tenant -> (live sequences, blocks held, quota or 0), for every tenant with sequences
        or a quota of its own."""
        seqs: dict[str, int] = dict.fromkeys(self.tenant_quotas, 0)
        for seq in self._sequences.values():
            seqs[seq.tenant] = seqs.get(seq.tenant, 0) + 1
        return {t: (n, self.tenant_blocks.get(t, 0), self.tenant_quota(t)) for t, n in seqs.items()}

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
            if not 1 <= n <= max_len:
                raise InvalidArgument(
                    f"items[{k}]: len(token_ids) = {n} is not in [1, max_model_len {max_len}]"
                )
            lookahead = item.num_lookahead_tokens
            if lookahead < 0:
                raise InvalidArgument(f"items[{k}].num_lookahead_tokens = {lookahead} must be >= 0")
            if n + lookahead > max_len:
                raise InvalidArgument(
                    f"items[{k}]: len(token_ids) + num_lookahead_tokens = {n + lookahead} exceeds "
                    f"max_model_len {max_len}"
                )
            where = f"items[{k}]"
            extra = self._extra_keys.get(where, item.cache_salt, item.adapter_id)
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
                room=self._room(table),
                num_published_blocks=len(hit),
            )
            self._sequences[sid] = seq
            self._by_lease.setdefault(lease_id, {})[sid] = seq
            self._charge(item.tenant, lease_id, len(table))
            stats.prefix_query_tokens += len(seq.token_ids)
            stats.prefix_hit_tokens += num_cached
            out.append(self._blocks_of(seq))
        if self.waiting_tenants:  # these tenants got blocks: they wait no more
            for item in items:
                self.waiting_tenants.pop(item.tenant, None)
        return out

    def extend(
        self, lease_id: str, items: list[tuple[int, int]], commits: list[tuple[int, list[int], int]] = ()
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
        self, lease_id: str, items: list[tuple[int, int]], pending: dict[int, int] | None = None
    ) -> list[SequenceBlocks]:
        """``extend``'s work. With ``pending`` (tokens a commit will append, per sequence id):
        validate and check room as if they were appended, change nothing, return []."""
        if len(items) > self.max_batch:
            check_batch(len(items), self.max_batch)
        sequences = self._sequences
        bs = self.block_size
        max_len = self.max_model_len
        seqs: list[Sequence] = []
        total_new = 0
        more_by_tenant: dict[str, int] = {}
        track = self._limited or self._contested()
        # NOTE: extend runs once per decode step per sequence, so validation is one combined
        # test per item; the slow path re-walks the batch to name the first bad item.
        for sid, num_tokens in items:
            seq = sequences.get(sid)
            if seq is None or seq.lease_id != lease_id or seq.location != DEVICE:
                self._raise_extend_error(lease_id, items)
            n = len(seq.token_ids) + (pending.get(sid, 0) if pending else 0)
            if not 0 <= num_tokens <= max_len - n:
                self._raise_extend_error(lease_id, items, pending)
            more = (n + num_tokens + bs - 1) // bs - len(seq.block_table)
            if more > 0:
                total_new += more
                if track:
                    more_by_tenant[seq.tenant] = more_by_tenant.get(seq.tenant, 0) + more
            seqs.append(seq)
        if len(items) > 1:
            check_unique([sid for sid, _ in items])
        bm = self.block_manager
        if more_by_tenant:
            self._check_limits(lease_id, more_by_tenant, total_new)
        if total_new > bm.num_free_blocks:
            raise ResourceExhausted(
                f"extend needs {total_new} new blocks but only {bm.num_free_blocks} of {bm.num_blocks} are free"
            )
        if pending is not None:
            return []

        if total_new:
            new_ids = bm.allocate(total_new)
            pos = 0
            for seq, (_, num_tokens) in zip(seqs, items, strict=True):
                more = (len(seq.token_ids) + num_tokens + bs - 1) // bs - len(seq.block_table)
                if more > 0:
                    self._charge(seq.tenant, lease_id, more)
                    seq.block_table += new_ids[pos : pos + more]
                    seq.room = self._room(seq.block_table)
                    seq.cached_blocks = None
                    pos += more
        blocks_of = self._blocks_of
        return [blocks_of(seq) for seq in seqs]

    def _raise_extend_error(
        self, lease_id: str, items: list[tuple[int, int]], pending: dict[int, int] | None = None
    ) -> None:
        for k, (sid, num_tokens) in enumerate(items):
            seq = owned(self._sequences, lease_id, k, sid)
            if num_tokens < 0:
                raise InvalidArgument(f"items[{k}].num_tokens = {num_tokens} must be >= 0")
            have = len(seq.token_ids) + (pending.get(sid, 0) if pending else 0)
            need = have + num_tokens
            if need > self.max_model_len:
                after = " (after the call's commits)" if pending else ""
                raise InvalidArgument(
                    f"items[{k}]: {have} tokens{after} + num_tokens {num_tokens} = {need} exceeds "
                    f"max_model_len {self.max_model_len}"
                )
        raise AssertionError("extend validation disagrees with its error path")

    def commit(self, lease_id: str, items: list[tuple[int, list[int], int]]) -> int:
        """Append generated tokens and record written KV; publish newly complete full blocks.

        Per item ``(sequence_id, new_token_ids, num_computed_tokens)``: the token count after
        appending must fit the block table; ``num_computed_tokens`` never decreases and never
        exceeds the token count. Every full block inside ``num_computed_tokens`` enters the
        prefix index. Returns the number of blocks published by the call.
        """
        return self._apply_commit(self._check_commit(lease_id, items), items)

    def _check_commit(self, lease_id: str, items: list[tuple[int, list[int], int]]) -> list[Sequence]:
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
                self._raise_commit_error(lease_id, items)
            n = len(seq.token_ids) + len(new_tokens)
            if (
                n > len(seq.block_table) * bs
                or n > max_len
                or not seq.num_computed_tokens <= num_computed <= n
            ):
                self._raise_commit_error(lease_id, items)
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

    def _apply_commit(self, seqs: list[Sequence], items: list[tuple[int, list[int], int]]) -> int:
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

    def _raise_commit_error(self, lease_id: str, items: list[tuple[int, list[int], int]]) -> None:
        bs = self.block_size
        for k, (sid, new_tokens, num_computed) in enumerate(items):
            seq = owned(self._sequences, lease_id, k, sid)
            n = len(seq.token_ids) + len(new_tokens)
            slots = len(seq.block_table) * bs
            if n > slots:
                raise InvalidArgument(
                    f"items[{k}]: {len(seq.token_ids)} tokens + {len(new_tokens)} new = {n} exceed the "
                    f"sequence's {slots} slots; Extend it first"
                )
            if n > self.max_model_len:
                raise InvalidArgument(f"items[{k}]: {n} tokens exceed max_model_len {self.max_model_len}")
            if not seq.num_computed_tokens <= num_computed <= n:
                raise InvalidArgument(
                    f"items[{k}].num_computed_tokens = {num_computed} is not in "
                    f"[{seq.num_computed_tokens} (already computed), {n} (tokens)]"
                )
        raise AssertionError("commit validation disagrees with its error path")

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

    def free(
        self, lease_id: str, sequence_ids: list[int], commits: list[tuple[int, list[int], int]] = ()
    ) -> int:
        """Drop sequences. Device blocks go to the LRU tail in reverse table order (still cached
        if committed); a swapped-out sequence releases its host slots. Returns device blocks released.
        ``commits`` are applied first (a finished sequence's last tokens), all or nothing.
        """
        checked = self._check_commit(lease_id, commits) if commits else []
        check_batch(len(sequence_ids), self.max_batch)
        seqs = [owned(self._sequences, lease_id, k, sid, location=None) for k, sid in enumerate(sequence_ids)]
        check_unique(sequence_ids)
        if commits:
            self._apply_commit(checked, commits)
        return sum(self._release(seq) for seq in seqs)

    def _release(self, seq: Sequence) -> int:
        self._charge(seq.tenant, seq.lease_id, -seq.num_blocks)
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

    def free_lease(self, lease_id: str, fence_until: float | None = None) -> int:
        """Release every sequence of a lease, on the device and on the host (lease expiry).

        Committed blocks stay in the prefix cache, so a retry elsewhere hits them. Returns
        device blocks released; an unknown lease releases nothing.

        With ``fence_until``, a device sequence's blocks from the first one holding an
        uncommitted slot on are not released but fenced until that time (``release_fenced``):
        a writer of the lease frozen inside a KV write can only finish it into them. Blocks
        wholly committed are never written again, so they are released at once.
        """
        fenced: list[int] = []
        released = 0
        bs = self.block_size
        for seq in self.sequences_of(lease_id):
            if fence_until is not None and seq.location == DEVICE:
                first_open = seq.num_computed_tokens // bs
                held = seq.block_table[first_open:]
                if held:  # charged to no tenant or lease while fenced
                    self._charge(seq.tenant, seq.lease_id, -len(held))
                    seq.block_table = seq.block_table[:first_open]
                    fenced += held
            released += self._release(seq)
        if fenced:
            self.fenced.append((fence_until, fenced, lease_id))
        return released

    @property
    def num_fenced_blocks(self) -> int:
        return sum(len(ids) for _, ids, _ in self.fenced)

    def release_fenced(self, now: float) -> int:
        """Free the fenced blocks whose time is up; returns how many."""
        released = 0
        while self.fenced and self.fenced[0][0] <= now:
            _, ids, _ = self.fenced.pop(0)
            released += len(ids)
            self.block_manager.free(ids[::-1])
        return released

    def release_fenced_of(self, lease_id: str) -> int:
        """Free the fenced blocks of ``lease_id`` now (its holder confirmed it writes no more)."""
        mine = [entry for entry in self.fenced if entry[2] == lease_id]
        for entry in mine:
            self.fenced.remove(entry)
            self.block_manager.free(entry[1][::-1])
        return sum(len(ids) for _, ids, _ in mine)

    def lookup_prefix(self, items: list[tuple[list[int], str, str]]) -> list[int]:
        """Per ``(token_ids, cache_salt, adapter_id)``: leading tokens cached on the device.

        Whole blocks only and NOT capped below the last token (a router wants the raw figure).
        Read-only: no reference taken, no LRU change, no stats.
        """
        check_batch(len(items), self.max_batch)
        keyed: list[tuple[bytes, bytes]] = []
        for k, (tokens, cache_salt, adapter_id) in enumerate(items):
            if len(tokens) > self.max_model_len:
                raise InvalidArgument(
                    f"items[{k}]: len(token_ids) = {len(tokens)} exceeds max_model_len {self.max_model_len}"
                )
            data = pack_checked(f"items[{k}]", tokens, self.vocab_size)
            extra = self._extra_keys.get(f"items[{k}]", cache_salt, adapter_id)
            keyed.append((data, extra))
        bm = self.block_manager
        bs = self.block_size
        return [len(bm.match_prefix(data, extra, len(data))[0]) * bs for data, extra in keyed]

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Block-manager invariants over all device tables, plus sequence and host-tier accounting."""
        bs = self.block_size
        device_tables = []
        host_slots: list[int] = []
        for sid, seq in self._sequences.items():
            assert seq.sequence_id == sid, f"sequence {sid} is filed under id {seq.sequence_id}"
            assert self._by_lease.get(seq.lease_id, {}).get(sid) is seq, (
                f"sequence {sid} missing from its lease index"
            )
            assert seq.prompt_bytes == pack_token_ids(seq.token_ids[: len(seq.prompt_bytes) // 4]), (
                f"sequence {sid}: prompt_bytes do not match its leading token ids"
            )
            assert seq.num_cached_tokens <= seq.num_computed_tokens <= len(seq.token_ids), (
                f"sequence {sid}: cached {seq.num_cached_tokens} <= computed {seq.num_computed_tokens} "
                f"<= tokens {len(seq.token_ids)} does not hold"
            )
            if seq.location == DEVICE:
                assert not seq.host_slots, f"device sequence {sid} holds host slots {seq.host_slots}"
                assert len(seq.token_ids) <= len(seq.block_table) * bs, (
                    f"sequence {sid}: {len(seq.token_ids)} tokens exceed {len(seq.block_table)} blocks"
                )
                assert seq.num_published_blocks <= min(len(seq.block_hashes), len(seq.block_table)), (
                    f"sequence {sid}: {seq.num_published_blocks} published blocks but {len(seq.block_hashes)} hashes"
                )
                assert seq.room == self._room(seq.block_table), (
                    f"sequence {sid}: room {seq.room} does not match {len(seq.block_table)} blocks"
                )
                device_tables.append(seq.block_table)
            else:
                assert seq.location == HOST, f"sequence {sid} has location {seq.location!r}"
                assert not seq.block_table, f"host sequence {sid} holds device blocks {seq.block_table}"
                assert len(seq.token_ids) <= len(seq.host_slots) * bs, (
                    f"sequence {sid}: {len(seq.token_ids)} tokens exceed {len(seq.host_slots)} host slots"
                )
                assert seq.room == 0, f"host sequence {sid} has room {seq.room}"
                host_slots += seq.host_slots
        n_lease_seqs = sum(len(v) for v in self._by_lease.values())
        assert n_lease_seqs == len(self._sequences), (
            f"lease index holds {n_lease_seqs} sequences, table holds {len(self._sequences)}"
        )
        assert all(self._by_lease.values()), "lease index keeps an empty lease"
        by_tenant: dict[str, int] = {}
        by_lease: dict[str, int] = {}
        for seq in self._sequences.values():
            if seq.num_blocks:
                by_tenant[seq.tenant] = by_tenant.get(seq.tenant, 0) + seq.num_blocks
                by_lease[seq.lease_id] = by_lease.get(seq.lease_id, 0) + seq.num_blocks
        assert by_tenant == self.tenant_blocks, (
            f"tenant block counts {self.tenant_blocks} != held {by_tenant}"
        )
        assert by_lease == self.lease_blocks, f"lease block counts {self.lease_blocks} != held {by_lease}"
        self.block_manager.check_invariants(device_tables + [ids for _, ids, _ in self.fenced])
        host = self.host_tier
        if host is None:
            assert not host_slots, "sequences hold host slots but there is no host tier"
            return
        assert sorted(host_slots) == host.used_slots(), (
            f"host slots held by sequences {sorted(host_slots)} != slots in use {host.used_slots()}"
        )
        assert host.num_used_blocks == len(host_slots), (
            f"host tier counts {host.num_used_blocks} used slots, sequences hold {len(host_slots)}"
        )
