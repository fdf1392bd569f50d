"""Per-tenant and per-lease limits of the sequence table: quotas and the fair share.

``TenantLimits`` decides whether a call may take more blocks for a tenant or a lease; the
``SequenceTable`` it serves asks it from Allocate, Extend and SwapIn before changing anything,
and tells it of every sequence added or released and every block charged. It reads the table's
sequences (the dict it is given) and the block manager's counts; it writes only its own counts.
Kept apart from the table's lifecycle because it is policy, not bookkeeping of sequences.

Quotas (0 = none): ``max_blocks_per_tenant`` (a tenant's default), ``tenant_quotas`` (per
tenant, over the default) and ``max_blocks_per_lease``. A tenant's or lease's blocks are the
blocks its live sequences hold on either tier (``Sequence.num_blocks``; a prefix block two of
them share counts for each holder), so swapping never changes them. Allocate and Extend refuse
growth past a quota with ResourceExhausted (the caller waits or preempts; TenantLimit, for a
tenant's quota, names the tenant, whose own sequences its replica preempts); an Allocate item
that alone exceeds a quota or the pool gets ExceedsLimit (it never fits).

Fair share (``fair_share``, on by default; nothing to do while fewer than two tenants
compete): the tenants competing are those holding blocks and those waiting (refused an
Allocate for lack of free blocks in the last ``FAIR_SHARE_WAIT_S``). Under pressure (a call
would leave fewer than ``fair_share_reserve`` blocks free, or another tenant is waiting), a
tenant that already holds its share of device blocks (``fair_shares`` of the pool, quotas as
caps) is refused more with TenantLimit naming the share, so its replica waits or
preempts; a tenant under its share is never refused for this (one call may take it past the
share).

Cost: block counts per tenant and per lease are kept as they change only while a quota needs
them (``limited``); otherwise ``tenant_blocks`` / ``lease_blocks`` count them when asked
(GetStats, checks). What every call keeps is the live sequences per tenant, which is all it
takes to know whether two tenants compete.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvtier.cachesvc.errors import ExceedsLimit, ResourceExhausted, TenantLimit

if TYPE_CHECKING:
    from kvtier.cachesvc.block_manager import BlockManager
    from kvtier.cachesvc.records import Sequence

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


def count(counts: dict[str, int], key: str, n: int) -> None:
    """``counts[key] += n``; a key leaves when it reaches 0."""
    left = counts.get(key, 0) + n
    if left:
        counts[key] = left
    else:
        del counts[key]


class TenantLimits:
    """Quotas and the fair share over ``sequences`` (sequence id -> record, the table's live
    sequences, read only) and ``block_manager`` (the device pool's counts). Units: blocks."""

    def __init__(
        self,
        block_manager: BlockManager,
        sequences: dict[int, Sequence],
        *,
        max_blocks_per_tenant: int = 0,
        tenant_quotas: dict[str, int] | None = None,
        max_blocks_per_lease: int = 0,
        fair_share: bool = True,
        fair_share_reserve: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self._sequences = sequences
        self.max_blocks_per_tenant = max_blocks_per_tenant
        self.tenant_quotas = dict(tenant_quotas or {})
        self.max_blocks_per_lease = max_blocks_per_lease
        # Whether any quota is set: only then are blocks counted as they change (see `charge`).
        self.limited = bool(max_blocks_per_tenant or self.tenant_quotas or max_blocks_per_lease)
        # Blocks held (either tier) per tenant and per lease, kept only while limited.
        self._tenant_blocks: dict[str, int] = {}
        self._lease_blocks: dict[str, int] = {}
        # Live sequences per tenant, always kept.
        self.tenant_sequences: dict[str, int] = {}
        self.fair_share = fair_share
        self.fair_share_reserve = fair_share_reserve
        # Waiting tenants (refused an Allocate for lack of blocks) -> monotonic time of refusal.
        self.waiting_tenants: dict[str, float] = {}

    # ------------------------------------------------------------------ counts

    @property
    def tenant_blocks(self) -> dict[str, int]:
        """Tenant -> blocks its live sequences hold on either tier (tenants holding none left out)."""
        return self._tenant_blocks if self.limited else self._count_blocks("tenant")

    @property
    def lease_blocks(self) -> dict[str, int]:
        """Lease id -> blocks its live sequences hold on either tier."""
        return self._lease_blocks if self.limited else self._count_blocks("lease_id")

    def _count_blocks(self, key: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for seq in self._sequences.values():
            if n := seq.num_blocks:
                holder = getattr(seq, key)
                counts[holder] = counts.get(holder, 0) + n
        return counts

    def charge(self, tenant: str, lease_id: str, blocks: int) -> None:
        """Count ``blocks`` (negative: released) against a tenant and a lease; callers call it
        only while ``limited``."""
        if blocks:
            count(self._tenant_blocks, tenant, blocks)
            count(self._lease_blocks, lease_id, blocks)

    def added(self, tenant: str, lease_id: str, blocks: int) -> None:
        """A sequence of ``tenant`` holding ``blocks`` blocks joined the table."""
        seqs = self.tenant_sequences
        seqs[tenant] = seqs.get(tenant, 0) + 1
        if self.limited:
            self.charge(tenant, lease_id, blocks)

    def released(self, tenant: str, lease_id: str, blocks: int) -> None:
        """A sequence of ``tenant`` holding ``blocks`` blocks left the table (``blocks`` is
        read only while ``limited``)."""
        if self.limited:
            self.charge(tenant, lease_id, -blocks)
        # count(tenant_sequences, tenant, -1), inline: once per Free
        seqs = self.tenant_sequences
        if left := seqs[tenant] - 1:
            seqs[tenant] = left
        else:
            del seqs[tenant]

    def admitted(self, tenants: list[str]) -> None:
        """These tenants got blocks from an Allocate: they wait no more."""
        waiting = self.waiting_tenants
        for tenant in tenants:
            waiting.pop(tenant, None)

    def tenant_quota(self, tenant: str) -> int:
        """Most blocks ``tenant`` may hold; 0 = no limit."""
        return self.tenant_quotas.get(tenant, self.max_blocks_per_tenant)

    def tenant_usage(self) -> dict[str, tuple[int, int, int]]:
        """Tenant -> (live sequences, blocks held, quota or 0), for every tenant with sequences
        or a quota of its own."""
        seqs = dict.fromkeys(self.tenant_quotas, 0) | self.tenant_sequences
        blocks = self.tenant_blocks
        return {t: (n, blocks.get(t, 0), self.tenant_quota(t)) for t, n in seqs.items()}

    # ------------------------------------------------------------------ checks

    def contested(self) -> bool:
        """Whether the fair share has two tenants to weigh (cheap: no tenants, no work)."""
        return self.fair_share and (len(self.tenant_sequences) > 1 or bool(self.waiting_tenants))

    def check_fits(self, where: str, tenant: str, blocks: int) -> None:
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

    def check(self, lease_id: str, more_by_tenant: dict[str, int], more: int) -> None:
        """Quotas, then the fair share, for ``more`` new blocks of a call."""
        if self.limited:
            self._check_quotas(lease_id, more_by_tenant, more)
        if self.fair_share:
            self.check_fair_share(more_by_tenant, more)

    def _check_quotas(self, lease_id: str, more_by_tenant: dict[str, int], more: int) -> None:
        """ResourceExhausted if ``more`` new blocks of a call would take its lease or a tenant
        past a quota (they would fit once the holder's own sequences finish)."""
        limit = self.max_blocks_per_lease
        if limit and more:
            held = self._lease_blocks.get(lease_id, 0)
            if held + more > limit:
                raise ResourceExhausted(
                    f"lease {lease_id[:8]}… holds {held} of the {limit} blocks one lease may hold "
                    f"(--max-blocks-per-lease); this call needs {more} more"
                )
        for tenant, want in more_by_tenant.items():
            quota = self.tenant_quota(tenant)
            held = self._tenant_blocks.get(tenant, 0)
            if quota and want and held + want > quota:
                raise TenantLimit(
                    f"tenant {tenant!r} holds {held} of its {quota}-block quota; this call needs {want} more",
                    tenant,
                )

    def note_waiting(self, tenants: set[str]) -> None:
        """Tenants refused for lack of free blocks while another tenant holds blocks wait."""
        holders = self.tenant_sequences
        if self.fair_share and holders:
            now = time.monotonic()
            for tenant in tenants:
                if len(holders) > 1 or tenant not in holders:
                    self.waiting_tenants[tenant] = now

    def check_fair_share(self, more_by_tenant: dict[str, int], more: int) -> None:
        """ResourceExhausted if, under pressure, a tenant of the call that holds its fair share
        of device blocks or more would take more (see the module docstring)."""
        waiting = self.waiting_tenants
        if waiting:
            cutoff = time.monotonic() - FAIR_SHARE_WAIT_S
            for tenant in [t for t, since in waiting.items() if since < cutoff]:
                del waiting[tenant]
        competing = set(self.tenant_sequences) | set(waiting) | {t for t, n in more_by_tenant.items() if n}
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
                held[seq.tenant] += len(seq.live_blocks)  # device blocks (none while swapped)
        for tenant, want in more_by_tenant.items():
            if want and held[tenant] >= shares[tenant]:
                why = (
                    f"tenant {others_waiting[0]!r} is waiting for blocks"
                    if others_waiting
                    else f"{free} of {bm.num_blocks} blocks are free"
                )
                raise TenantLimit(
                    f"tenant {tenant!r} holds {held[tenant]} device blocks, at or over its fair share "
                    f"of {shares[tenant]} blocks ({bm.num_blocks} among {len(competing)} tenants), "
                    f"and the pool is under pressure ({why}); this call needs {want} more",
                    tenant,
                )
