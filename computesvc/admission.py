"""Admission: which waiting requests get KV blocks this step, and which fail instead.

Waiting is first come, first served within a tenant. `Admission.admit` sends the head of the
queue out in one batched `Allocate`, as many requests as there are free seats and tokens to
compute in the step's budget. A request is charged its tokens less those surely a prefix hit
(`sure_hits`: whole blocks it shares with the committed prompt of a sequence running here, which
holds them), as vLLM charges only uncached tokens; a prompt that shares nothing is charged
whole, as before. A request that shares whole blocks with a prompt admitted in the same batch or
still prefilling here waits (keeping its place) until that prompt is committed, and then hits it:
admitted at once it would compute the same blocks again (a shared-prefix burst computed each
system prompt up to 3 times in one step). Prefill chunks by the same budget, so a step never
computes more. A batch the pool cannot hold is halved until it fits; a batch with an item the
cache refuses (INVALID_ARGUMENT) or that can never fit (ExceedsLimit, checked before room) is
retried one request per call, so only those requests fail (`RequestRefused`, or the
ExceedsLimit itself). A head that finds no room fails at once when it can never fit
(ExceedsLimit), or once it has waited `admit_timeout_s` with nothing running, and it never holds
up other tenants: the oldest request of another tenant may still fit. The scheduler
(computesvc.scheduler) decides when admission runs and starts what it admits.

A tenant whose own quota or share refused an Allocate (TenantLimited) is held back: its
requests are not sent again until one of its sequences here finishes (the scheduler lifts the
hold) or a while passes (its blocks may be held by other replicas): 0.05 s, doubling
with each refusal in a row, at most 0.5 s. Retrying every step cost everyone: a refused call or
two per decode step, and every step four times slower.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING

from kvtier.computesvc.cache_port import ExceedsLimit, NoFreeBlocks, SequenceBlocks, TenantLimited
from kvtier.computesvc.preemption import backoff_s
from kvtier.computesvc.request import Request, Status
from kvtier.computesvc.token_emitter import TokenEmitter

if TYPE_CHECKING:
    from kvtier.computesvc.scheduler import SchedulerConfig

log = logging.getLogger("kvtier.compute")

# How long a tenant refused by its own limit waits before its requests are sent again (unless one
# of its sequences here finishes first): doubling with each refusal in a row, capped. The cap
# bounds how late a request sees blocks its tenant freed on another replica.
QUOTA_RETRY_S = 0.05
MAX_QUOTA_RETRY_S = 0.5


def by_first_block(reqs: list[Request], block_size: int) -> dict[tuple, list[Request]]:
    """`reqs` by (salt, first prompt block): the key under which another prompt's Allocate can
    hit their blocks."""
    found: dict[tuple, list[Request]] = {}
    for r in reqs:
        found.setdefault((r.tenant_salt, tuple(r.prompt_token_ids[:block_size])), []).append(r)
    return found


def committed_prompts(running: list[Request], block_size: int) -> dict[tuple, list[Request]]:
    """The sequences running here whose committed prompt blocks are all still held (no window
    released any), by `by_first_block`: while a sequence holds a committed block, the cache
    cannot evict it, so an Allocate of the same tokens under the same salt hits it."""
    return by_first_block(
        [
            r
            for r in running
            if r.status is Status.RUNNING and not r.num_released_blocks and r.num_committed >= block_size
        ],
        block_size,
    )


def prefilling_prompts(running: list[Request], block_size: int) -> dict[tuple, list[Request]]:
    """The sequences running here still prefilling their prompt (committed once it is done), by
    `by_first_block`."""
    return by_first_block([r for r in running if r.status is Status.RUNNING and r.prefilling], block_size)


def sure_hits(req: Request, held: dict[tuple, list[Request]], block_size: int, committed: bool = True) -> int:
    """Leading tokens of `req` its Allocate surely finds cached: the whole blocks of its prompt
    that a sequence in `held` (`committed_prompts`) committed, capped as the cache caps a hit
    (the last prompt token is always computed). 0 when it shares no block with one. With
    `committed` False, the blocks the sequences in `held` will commit once prefilled (their
    whole prompt blocks), committed or not."""
    bs = block_size
    prompt = req.prompt_token_ids
    cap = (len(prompt) - 1) // bs
    best = 0
    for r in held.get((req.tenant_salt, tuple(prompt[:bs])), ()):
        done = r.num_committed if committed else len(r.prompt_token_ids)
        limit = min(cap, done // bs, len(r.prompt_token_ids) // bs)
        n = 1
        while n < limit and prompt[n * bs : (n + 1) * bs] == r.prompt_token_ids[n * bs : (n + 1) * bs]:
            n += 1
        best = max(best, min(n, limit))
    return best * bs


class RequestRefused(Exception):
    """The cache service refused this request's own item of a batched call (INVALID_ARGUMENT)."""


class Admission:
    """Admits from a waiting queue. allocate: one traced Allocate for a batch of requests (their
    blocks, in order); start: `req` got its blocks and runs; emitter: ends the requests that fail;
    held_back: the scheduler's tenant -> until when (monotonic s) it is not admitted, where a
    tenant refused by its own limit is put (the scheduler lifts it when one of its sequences
    finishes)."""

    def __init__(
        self,
        config: SchedulerConfig,
        allocate: Callable[[list[Request]], Awaitable[list[SequenceBlocks]]],
        start: Callable[[Request, SequenceBlocks], None],
        emitter: TokenEmitter,
        held_back: dict[str, float],
        block_size: int = 16,
    ):
        self.config = config
        self.block_size = block_size
        self.allocate = allocate
        self.start = start
        self.emitter = emitter
        self.held_back = held_back
        self._refusals: dict[str, int] = {}  # tenant -> its own limit's refusals in a row

    def _hold(self, tenant: str) -> None:
        """`tenant`'s own limit refused its Allocate: send none of its requests for a while."""
        refusals = self._refusals[tenant] = self._refusals.get(tenant, 0) + 1
        until = time.monotonic() + backoff_s(refusals, QUOTA_RETRY_S, MAX_QUOTA_RETRY_S)
        self.held_back[tenant] = max(self.held_back.get(tenant, 0.0), until)

    async def admit(
        self, waiting: deque[Request], running: list[Request], held_back: Collection[str] = ()
    ) -> None:
        """Allocate blocks for the head of `waiting` (FCFS), one batched call, with `running` the
        sequences running now (read only: `start` adds to it), passing over the requests of the
        tenants `held_back` (their own limit preempted one of theirs: they wait a while, or until
        one of their running sequences finishes). Admitted and failed requests leave `waiting`."""
        room = self.config.max_num_seqs - len(running)
        budget = self.config.max_num_batched_tokens
        batch: list[Request] = []
        bs = self.block_size
        held = committed_prompts(running, bs) if room > 0 else {}
        computing = prefilling_prompts(running, bs) if room > 0 else {}  # + this batch, below
        for req in (r for r in waiting if r.tenant not in held_back):
            if len(batch) >= room:
                break
            hit = sure_hits(req, held, bs)
            if sure_hits(req, computing, bs, committed=False) > hit:
                continue  # its blocks are being computed: it hits them once they are committed
            cost = req.num_tokens - hit
            if batch and cost > budget:
                break
            batch.append(req)
            budget -= cost
            computing.setdefault((req.tenant_salt, tuple(req.prompt_token_ids[:bs])), []).append(req)
        seqs: list[SequenceBlocks] = []  # none when no room (max_num_seqs running)
        while batch:
            try:
                seqs = await self.allocate(batch)
                break
            except TenantLimited as e:
                if len(batch) == 1:
                    self._hold(e.tenant)
                    self._expire_stuck(waiting, running, batch[0], e)
                    await self._admit_another_tenant(waiting, running, {e.tenant, *held_back})
                    return
                batch = self._without_refused(batch, e.tenant)
            except NoFreeBlocks as e:
                if isinstance(e, ExceedsLimit) and len(batch) > 1:
                    # One item can never fit (the cache tests that before room): find it.
                    batch, seqs = await self._allocate_one_by_one(waiting, batch)
                    break
                if len(batch) == 1:
                    self._expire_stuck(waiting, running, batch[0], e)
                    await self._admit_another_tenant(waiting, running, {batch[0].tenant, *held_back})
                    return
                batch = batch[: len(batch) // 2]
            except ValueError as e:
                # The cache refused an item (INVALID_ARGUMENT): find it, one call per item, and
                # fail only the refused requests, each with its own item's error.
                if len(batch) == 1:
                    self._refuse(waiting, batch[0], e)
                    return
                batch, seqs = await self._allocate_one_by_one(waiting, batch)
                break
        self._started(waiting, batch, seqs)

    def _started(self, waiting: deque[Request], admitted: list[Request], seqs: list[SequenceBlocks]) -> None:
        for req, seq in zip(admitted, seqs, strict=True):
            waiting.remove(req)
            self._refusals.pop(req.tenant, None)
            self.start(req, seq)

    def _without_refused(self, batch: list[Request], tenant: str) -> list[Request]:
        """The batch to try after `tenant`'s own limit refused `batch`: with only the first of
        its requests when it had several (one may still fit), else without it (then held back)."""
        mine = [r for r in batch if r.tenant == tenant]
        if len(mine) > 1:
            return [r for r in batch if r.tenant != tenant or r is mine[0]]
        if mine:
            self._hold(tenant)
            return [r for r in batch if r.tenant != tenant]
        return batch[: len(batch) // 2]  # (a tenant not in the call: as if the pool refused it)

    async def _admit_another_tenant(
        self, waiting: deque[Request], running: list[Request], passed_over: Collection[str]
    ) -> None:
        """The oldest waiting request found no room. Waiting is first come, first served within
        a tenant, not across tenants: the oldest request of another tenant may still fit (a
        smaller one, or one under its fair share, which the cache service does not refuse), so
        one tenant's request that cannot fit never holds up the others. `passed_over`: the
        refused request's tenant and those held back."""
        if len(running) >= self.config.max_num_seqs:
            return
        other = next((r for r in waiting if r.tenant not in passed_over), None)
        if other is None:
            return
        try:
            (seq,) = await self.allocate([other])
        except TenantLimited as e:
            self._hold(e.tenant)
            return
        except (NoFreeBlocks, ValueError):
            return  # it waits its turn (a refused item is failed when it reaches the head)
        self._started(waiting, [other], [seq])

    async def _allocate_one_by_one(
        self, waiting: deque[Request], batch: list[Request]
    ) -> tuple[list[Request], list[SequenceBlocks]]:
        """Allocate `batch` one request per call after a batched Allocate was refused: refused
        requests and those that can never fit leave the queue failed; stop at the first that
        finds no room. Returns the admitted requests (the head of the queue, in order) and their
        blocks."""
        admitted: list[Request] = []
        seqs: list[SequenceBlocks] = []
        for req in batch:
            try:
                (seq,) = await self.allocate([req])
            except ValueError as e:
                self._refuse(waiting, req, e)
                continue
            except ExceedsLimit as e:
                waiting.remove(req)
                self.emitter.finish(req, "", error=e)
                continue
            except NoFreeBlocks:
                break
            admitted.append(req)
            seqs.append(seq)
        return admitted, seqs

    def _refuse(self, waiting: deque[Request], req: Request, error: ValueError) -> None:
        waiting.remove(req)
        log.warning("request %s refused by the cache service: %s", req.request_id, error)
        self.emitter.finish(req, "", error=RequestRefused(str(error)))

    def _expire_stuck(
        self, waiting: deque[Request], running: list[Request], req: Request, error: NoFreeBlocks
    ) -> None:
        """Fail a request that found no blocks: at once if it can never fit (ExceedsLimit: over
        its tenant's quota or the pool), else once it has waited admit_timeout_s."""
        if isinstance(error, ExceedsLimit):
            waiting.remove(req)
            self.emitter.finish(req, "", error=error)
        elif not running and time.monotonic() - req.arrival > self.config.admit_timeout_s:
            waiting.remove(req)
            self.emitter.finish(
                req,
                "",
                error=NoFreeBlocks(
                    f"no KV blocks for a {req.num_tokens}-token sequence after "
                    f"{self.config.admit_timeout_s:.0f}s: the pool is too small or held by other replicas"
                ),
            )
