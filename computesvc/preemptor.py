"""Decode slots and preemption: the scheduler's collaborator that tops up the reserved slots of
decoding sequences and, when the cache has no room, preempts the sequence computesvc.preemption
picks (swap out or free to recompute), measuring what the cost model reads.

Kept apart from the scheduler's step because it is the one place a step acts on another
request's state for lack of room; the step calls `reserve_slots` (and `has_slot`) and nothing
else here. It works on the scheduler's queues, which it is handed at construction (the scheduler
mutates them in place, never rebinds them).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvtier.computesvc.cache_port import BlockCache, ExtendItem, NoFreeBlocks, ReleaseItem, TenantLimited
from kvtier.computesvc.observer import SchedulerObserver
from kvtier.computesvc.preemption import SWAP, Candidate, Ledger, Pressure, backoff_s, choose_victim
from kvtier.computesvc.request import Request, Status, commit_items, mark_committed
from kvtier.computesvc.window import blocks_behind, release_window

if TYPE_CHECKING:
    from kvtier.computesvc.model import ModelRunner
    from kvtier.computesvc.scheduler import SchedulerConfig


class Preemptor:
    """Slots and preemption over the scheduler's queues, with explicit inputs."""

    def __init__(
        self,
        *,
        config: SchedulerConfig,
        observer: SchedulerObserver,
        ledger: Ledger,
        call: Callable[..., Awaitable],
        running: list[Request],
        waiting: deque[Request],
        swapped: deque[Request],
        held_back: dict[str, float],
    ) -> None:
        self.config = config
        self.observer = observer
        self.ledger = ledger  # what the cost model remembers (shared with the scheduler's step)
        self._call = call  # Scheduler._call: one counted, traced BlockCache call
        self.running = running
        self.waiting = waiting
        self.swapped = swapped
        # Tenants held back from admission -> until when (monotonic s); the scheduler reads it.
        self.held_back = held_back

    def attach(self, runner: ModelRunner, cache: BlockCache) -> None:
        """The runner (its pool, its model's window) and cache of the replica's current
        attachment (`Scheduler.attach`)."""
        self.cache = cache
        self.block_size = cache.block_size
        pool = runner.pool
        self.block_bytes = pool[0].numel() * pool.element_size()  # one block, every layer, K and V
        # Set when every layer has a sliding window: each Extend then gives back what it left behind.
        self.window = release_window(runner.model.config)

    def has_slot(self, req: Request) -> bool:
        """Whether `req`'s block table has room for its next token's KV."""
        return self._slots(req) > req.num_computed

    def _slots(self, req: Request) -> int:
        return len(req.block_table) * self.block_size

    async def reserve_slots(self, decoding: list[Request]) -> None:
        """Make sure each decoding sequence has a slot for this step's token.

        NOTE: called rarely on purpose. When one sequence runs out, every sequence below one
        block of headroom is topped up to `lookahead_blocks` in the same call, so with a batch
        in flight most steps make no cache call at all.
        """
        if all(self._slots(r) > r.num_computed for r in decoding):
            return
        low = [r for r in decoding if self._slots(r) - r.num_computed <= self.block_size]
        while low:
            try:
                await self._extend(low)
                return
            except NoFreeBlocks as refused:
                if await self._release_behind(low):
                    continue  # what the windows left behind may be the room that was missing
                low, tenant = await self._extend_apart(low, refused)
                if tenant is None:  # the pool is short (a tenant's own limit holds back no one else)
                    self.ledger.refused_at = self.ledger.step
            if not low:
                return
            # Waiting is an option while any other running sequence can still make progress.
            victim = await self._preempt(tenant, can_wait=len(low) < len(self.running))
            if victim is None:
                return  # those in `low` wait for room (the step decodes the others)
            low = [r for r in low if r is not victim]

    async def _extend(self, reqs: list[Request], room: bool = True) -> None:
        """One Extend topping `reqs` up to the lookahead (`room` False: asking none), carrying their
        commits and what their windows left behind: the tokens written since the last call are
        committed, then the room is counted from the record as it is."""
        commits = commit_items(reqs)
        lookahead = self.config.lookahead_blocks * self.block_size
        max_len = self.cache.max_model_len
        items = [
            ExtendItem(r.sequence_id, max(1, min(lookahead, max_len - max(r.num_recorded, r.num_computed))))
            if room
            else ExtendItem(r.sequence_id, 0)
            for r in reqs
        ]
        releases = self._releases(reqs)
        seqs = await self._call(self.cache.extend(items, commits, releases), reqs)
        mark_committed(reqs)
        released = dict(releases)
        for req, seq in zip(reqs, seqs, strict=True):
            req.block_table = seq.block_table
            req.num_released_blocks = released.get(req.sequence_id, req.num_released_blocks)

    async def _release_behind(self, reqs: list[Request]) -> bool:
        """After the Extend of `reqs` was refused (nothing applied): give back only what their
        windows left behind, in an Extend asking no room (it always fits) that carries their
        commits, so that a retry may find the room. False when nothing was behind."""
        behind = {sequence_id for sequence_id, _ in self._releases(reqs)}
        if not behind:
            return False
        await self._extend([r for r in reqs if r.sequence_id in behind], room=False)
        return True

    def _releases(self, reqs: list[Request]) -> list[ReleaseItem]:
        """The blocks each of `reqs` has left behind its window since its last release (none
        unless every layer of the model is windowed). Counted from `num_computed`, which the
        Extend carrying them commits first."""
        window = self.window
        if window is None:
            return []
        items = []
        for req in reqs:
            behind = blocks_behind(req.num_computed, window, self.block_size)
            if behind > req.num_released_blocks:
                items.append(ReleaseItem(req.sequence_id, behind))
        return items

    async def _extend_apart(
        self, low: list[Request], error: NoFreeBlocks
    ) -> tuple[list[Request], str | None]:
        """After the Extend of `low` was refused with `error` (nothing applied), with the cost
        policy: extend each tenant's sequences in a call of their own, so one tenant's quota or
        share fails only its own. Returns the sequences still without room and the tenant whose
        own limit refused them: one the cache named (TenantLimited), else the one refused tenant
        when another tenant's call succeeded, or the only tenant of `low` when it holds more than
        an even share of this replica's blocks; else None (the pool)."""
        tenants = list(dict.fromkeys(r.tenant for r in low))
        if self.config.preemption_policy != "cost":
            return low, None
        if len(tenants) == 1:
            named = isinstance(error, TenantLimited) or self._over_share(tenants[0])
            return low, tenants[0] if named else None
        refused: list[Request] = []
        limited: list[str] = []
        for tenant in tenants:
            group = [r for r in low if r.tenant == tenant]
            try:
                await self._extend(group)
            except TenantLimited:
                refused += group
                limited.append(tenant)
            except NoFreeBlocks:
                refused += group
        if limited:
            return refused, limited[0]
        alone = {r.tenant for r in refused}
        return refused, alone.pop() if len(alone) == 1 and len(refused) < len(low) else None

    def _over_share(self, tenant: str) -> bool:
        """Whether `tenant` holds more than an even share of the running sequences' blocks."""
        held: dict[str, int] = {}
        for r in self.running:
            held[r.tenant] = held.get(r.tenant, 0) + len(r.block_table) - r.num_released_blocks
        return len(held) > 1 and held.get(tenant, 0) > sum(held.values()) / len(held)

    def _candidate(self, req: Request) -> Candidate:
        generated = len(req.output_token_ids)
        remaining = min(req.params.max_tokens - generated, self.cache.max_model_len - req.num_tokens)
        return Candidate(
            req,
            req.arrival,
            req.tenant,
            req.num_computed,
            len(req.block_table) - req.num_released_blocks,  # what a swap would move
            generated,
            max(0, remaining),
            self.ledger.preemptions(req),
            self.ledger.resident_steps(req),
        )

    async def _preempt(self, refused_tenant: str | None = None, can_wait: bool = False) -> Request | None:
        """Preempt the running sequence the policy picks (computesvc.preemption): swap it out, or
        free it to recompute later. None when there is none, or when it is better to wait."""
        cfg = self.config
        pressure = Pressure(
            self.block_bytes,
            self.ledger.host_has_room,
            refused_tenant,
            can_wait,
            cfg.min_resident_steps,
            cfg.max_preemptions,
        )
        candidates = [self._candidate(r) for r in self.running]
        if not candidates:
            return None
        decision = choose_victim(candidates, self.ledger.rates, pressure, cfg.preemption_policy)
        if decision is None:
            self.observer.on_preemption_deferred(len(candidates))
            return None
        victim: Request = decision.victim.key
        with self.observer.preempt_span(victim, decision) as span:
            moved = await self._swap_out(victim) if decision.mode == SWAP else None
            if moved is None:
                # Drop the blocks; the committed ones stay cached, so recompute of this sequence
                # is mostly prefix hits.
                await self._call(self.cache.free([victim.sequence_id], commit_items([victim])), [victim])
                mark_committed([victim])
                self.running.remove(victim)
                victim.status = Status.WAITING
                victim.block_table = []
                victim.num_released_blocks = 0  # readmitted as a new sequence
                self.waiting.appendleft(victim)
            self.ledger.preempted(victim)
            if moved is None and self.config.preemption_policy == "cost":
                # Freed to make room: readmitting it at once would take that room straight back.
                wait_s = backoff_s(self.ledger.preemptions(victim))
                self.held_back[victim.tenant] = max(
                    self.held_back.get(victim.tenant, 0.0), time.monotonic() + wait_s
                )
            self.observer.on_preempted(span, victim, moved, decision)
        return victim

    async def _swap_out(self, victim: Request) -> int | None:
        """SwapOut `victim` (carrying its commit): the bytes moved, or None when the host tier
        has no room (then it is remembered as full until a SwapIn frees slots)."""
        started = time.perf_counter()
        try:
            moved = await self._call(
                self.cache.swap_out([victim.sequence_id], commit_items([victim])), [victim]
            )
        except NoFreeBlocks:
            self.ledger.host_has_room = False
            return None
        self.ledger.rates.observe_swap(moved, time.perf_counter() - started)
        mark_committed([victim])
        # NOTE: it leaves `running` only once the cache took it: if a call fails, _abandon_all
        # still finds (and frees) its sequence.
        self.running.remove(victim)
        victim.status = Status.SWAPPED
        self.swapped.append(victim)
        return moved
