"""The plans of the calls that take device blocks, before the sequence table takes any.

``plan_allocate`` (each new sequence checked, keyed, matched against the prefix index and
weighed against the limits) and ``plan_extend`` (each sequence checked and the blocks it needs
counted) are phase 1 of ``SequenceTable.allocate`` / ``extend``: they read and change nothing,
so a refused call leaves the cache as it was. Each check is written once, next to its message.
Two steps that do take blocks live here too, beside the checks they rely on: ``grow_one`` (an
Extend of one sequence across a block boundary, checked and done in one go, or left to the full
path) and ``promote_lower_hits`` (Allocate's phase 3 with lower tiers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.block_hash import BlockHash
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import InvalidArgument
from kvtier.cachesvc.limits import TenantLimits
from kvtier.cachesvc.records import DEVICE, Sequence
from kvtier.cachesvc.validation import ExtraKeys, check_batch, check_unique, owned, pack_checked
from kvtier.sequence_types import AllocateItem, ExtendItem

if TYPE_CHECKING:
    from kvtier.cachesvc.lower_tiers import TierStack


@dataclass(slots=True)
class AllocatePlan:
    """What one allocate item will get: its hit (block ids), the new blocks it needs, and the
    keys computed on the way (kept with the sequence so they are never computed again)."""

    block_hashes: list[BlockHash]  # hashes of the hit blocks, in token order
    hit: list[int]
    num_new_blocks: int
    extra: bytes  # extra_key(model, tenant_salt, adapter_id)
    prompt_bytes: bytes  # the prompt as pack_token_ids bytes


def plan_allocate(
    lease_id: str,
    items: list[AllocateItem],
    block_manager: BlockManager,
    limits: TenantLimits,
    extra_keys: ExtraKeys,
    vocab_size: int,
    max_model_len: int,
) -> tuple[list[AllocatePlan], list[int], int]:
    """One plan per item, the hit block ids of all items (to touch), and the new blocks the
    batch needs. Raises the first item's error, or the limits' refusal, changing nothing.

    A hit is whole blocks, capped so the last prompt token is always computed (its logits are
    needed); blocks cover ``len(token_ids) + num_lookahead_tokens`` tokens.
    """
    bm = block_manager
    bs = bm.block_size
    plans: list[AllocatePlan] = []
    touched: list[int] = []
    total_new = 0
    held_by_tenant: dict[str, int] = {}
    track = limits.limited or limits.contested()
    for k, item in enumerate(items):
        tokens = item.token_ids
        n = len(tokens)
        lookahead = item.num_lookahead_tokens
        if not 1 <= n <= max_model_len:
            raise InvalidArgument(
                f"items[{k}]: len(token_ids) = {n} is not in [1, max_model_len {max_model_len}]"
            )
        if lookahead < 0:
            raise InvalidArgument(f"items[{k}].num_lookahead_tokens = {lookahead} must be >= 0")
        if n + lookahead > max_model_len:
            raise InvalidArgument(
                f"items[{k}]: len(token_ids) + num_lookahead_tokens = {n + lookahead} exceeds "
                f"max_model_len {max_model_len}"
            )
        where = f"items[{k}]"
        extra = extra_keys.get(where, item.tenant_salt, item.adapter_id)
        data = pack_checked(where, tokens, vocab_size)
        hit, hashes = bm.match_prefix(data, extra, (n - 1) // bs)
        num_new = -(-(n + lookahead) // bs) - len(hit)
        if track or num_new + len(hit) > bm.num_blocks:
            limits.check_fits(where, item.tenant, num_new + len(hit))
            held_by_tenant[item.tenant] = held_by_tenant.get(item.tenant, 0) + num_new + len(hit)
        total_new += num_new
        touched += hit
        plans.append(AllocatePlan(hashes, hit, num_new, extra, data))
    if track:
        limits.check(lease_id, held_by_tenant, sum(held_by_tenant.values()))
    return plans, touched, total_new


def grow_one(
    seq: Sequence,
    lease_id: str,
    num_tokens: int,
    bm: BlockManager,
    limits: TenantLimits,
    max_model_len: int,
    lower: TierStack | None,
) -> bool:
    """Extend of one sequence asking ``num_tokens`` more than it has room for: once per
    ``block_size`` decode steps a step crosses a block boundary. A device sequence of the lease
    under no limits, within ``max_model_len``, with the blocks free, gets them here (``plan_extend``
    and ``SequenceTable._extend`` without their lists): True, the blocks it evicted handed down to
    ``lower``. Anything else changes nothing and returns False for the full path, which checks
    and refuses."""
    need = len(seq.token_ids) + num_tokens
    if not (
        seq.lease_id == lease_id
        and num_tokens >= 0
        and need <= max_model_len
        and seq.location == DEVICE
        and not limits.limited
        and not limits.contested()
    ):
        return False
    bs = bm.block_size
    table = seq.block_table
    more = (need + bs - 1) // bs - len(table)
    if more > bm.free_queue.num_free:
        return False
    if more == 1:
        table.append(bm.allocate_one())
    else:
        table += bm.allocate(more)
    if bm.evicted_ids:
        lower.keep_evicted(bm)
    seq.room = min(len(table) * bs, max_model_len)  # SequenceTable.room(), inline
    seq.cached_blocks = None
    return True


def promote_lower_hits(
    lower: TierStack,
    bm: BlockManager,
    plan: AllocatePlan,
    table: list[int],
    token_ids: list[int],
    tenant: str = "",
) -> int:
    """Phase 3 of Allocate with lower tiers, for one new sequence holding ``table``: follow its
    prompt's chain past the device hit through the tiers below (``TierStack``), copy the held
    blocks into the table's fresh blocks after the hit and publish them. Returns the blocks
    promoted (they count as cached: compute sees ordinary cached blocks). Capped, as the device
    hit is, so the last prompt token is always computed. A block a tier fails to give (a
    record that fails its checks) ends the run: what follows stays a fresh block to compute.
    ``tenant``: the sequence's (the shared tier looks, loads and publishes as that tenant).
    """
    if tenant:
        lower.note_tenant(plan.extra, tenant)
    if lower.min_hits and plan.hit:
        lower.note_hits([bm.blocks[i].index_key for i in plan.hit])
    start = len(plan.hit)
    parent = plan.block_hashes[-1] if start else plan.extra
    end = (len(token_ids) - 1) // bm.block_size
    keys = lower.held_keys(plan.prompt_bytes, parent, bm.block_size, start, end, plan.block_hashes, tenant)
    if not keys:
        return 0
    got = lower.promote(keys, table[start : start + len(keys)], tenant)
    if got:
        bm.publish_blocks(
            table, plan.block_hashes, start, start + got, token_ids, plan.extra, plan.prompt_bytes, tenant
        )
    return got


def lookup_tiers(
    bm: BlockManager, lower: TierStack, keyed: list[tuple[bytes, bytes]], below: list[tuple[int, ...]]
) -> list[int]:
    """LookupPrefix over every tier: per ``(prompt bytes, extra key)`` the device tokens (returned)
    and, appended to ``below``, the tokens per lower medium (``kvtier.media.LOWER_MEDIA`` order)
    of the chain past the device hit. Whole blocks, uncapped; read-only. The shared tier counts
    as the tenant an Allocate under the same chain root named lately (``TierStack.tenant_of``;
    else the default, whose namespace holds no other tenant's objects: 0 there)."""
    bs = bm.block_size
    out = []
    for data, extra in keyed:
        ids, hashes = bm.match_prefix(data, extra, len(data))
        counts = lower.count_below(data, hashes[-1] if ids else extra, bs, len(ids), lower.tenant_of(extra))
        out.append(len(ids) * bs)
        below.append(tuple(n * bs for n in counts))
    return out


def plan_extend(
    sequences: dict[int, Sequence],
    block_size: int,
    max_model_len: int,
    max_batch: int,
    lease_id: str,
    items: list[ExtendItem],
    pending: dict[int, int] | None = None,
) -> tuple[list[Sequence], list[tuple[Sequence, int]], int]:
    """The sequences of Extend ``items`` in order, those crossing a block boundary with the new
    blocks each needs, and the total; after checking each item (``pending``: tokens the call's
    commits append, per sequence id). Changes nothing. The table's bounds come first."""
    if len(items) > max_batch:
        check_batch(len(items), max_batch)
    seqs = []
    grow: list[tuple[Sequence, int]] = []
    total_new = 0
    for k, (sid, num_tokens) in enumerate(items):
        seq = owned(sequences, lease_id, k, sid)
        if num_tokens < 0:
            raise InvalidArgument(f"items[{k}].num_tokens = {num_tokens} must be >= 0")
        have = len(seq.token_ids) + (pending.get(sid, 0) if pending else 0)
        if have + num_tokens > max_model_len:
            after = " (after the call's commits)" if pending else ""
            raise InvalidArgument(
                f"items[{k}]: {have} tokens{after} + num_tokens {num_tokens} = {have + num_tokens} exceeds "
                f"max_model_len {max_model_len}"
            )
        more = (have + num_tokens + block_size - 1) // block_size - len(seq.block_table)
        if more > 0:
            total_new += more
            grow.append((seq, more))
        seqs.append(seq)
    if len(items) > 1:
        check_unique([sid for sid, _ in items])
    return seqs, grow, total_new
