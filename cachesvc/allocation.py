"""Allocate's plan: each new sequence checked, keyed, matched against the prefix index and
weighed against the limits, before the sequence table takes a block.

``plan_allocate`` is phases 1 and 2 of ``SequenceTable.allocate`` up to the pool's room: it
reads the block manager (prefix index, capacity) and the limits and changes nothing, so a
refused call leaves the cache as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachesvc.block_manager import BlockManager
from cachesvc.limits import TenantLimits
from cachesvc.validation import ExtraKeys, check_allocate_item, pack_checked
from kvtier.block_hash import BlockHash
from kvtier.sequence_types import AllocateItem


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
        check_allocate_item(k, n, item.num_lookahead_tokens, max_model_len)
        where = f"items[{k}]"
        extra = extra_keys.get(where, item.tenant_salt, item.adapter_id)
        data = pack_checked(where, tokens, vocab_size)
        hit, hashes = bm.match_prefix(data, extra, (n - 1) // bs)
        num_new = -(-(n + item.num_lookahead_tokens) // bs) - len(hit)
        if track or num_new + len(hit) > bm.num_blocks:
            limits.check_fits(where, item.tenant, num_new + len(hit))
            held_by_tenant[item.tenant] = held_by_tenant.get(item.tenant, 0) + num_new + len(hit)
        total_new += num_new
        touched += hit
        plans.append(AllocatePlan(hashes, hit, num_new, extra, data))
    if track:
        limits.check(lease_id, held_by_tenant, sum(held_by_tenant.values()))
    return plans, touched, total_new
