"""Continuous batching over the cache service's blocks.

One asyncio task runs `step()` in a loop. A step:

1. resumes swapped-out sequences (`SwapIn`), then admits waiting requests with one batched
   `Allocate` (prefix hits skip prefill of their cached part);
2. prefills the uncached tokens of new sequences, chunked by the token budget, and commits
   the finished prompts so other requests can hit them at once;
3. tops up the reserved slots of decoding sequences when one runs out (`Commit` + `Extend`
   for every sequence below the low-water mark, so most steps make no cache call), preempting
   on RESOURCE_EXHAUSTED the sequence cheapest to bring back (computesvc.preemption: swap or
   recompute, the refused tenant's own sequences first, guarded against thrash);
4. runs one batched decode forward for all running sequences and streams their tokens;
5. commits and frees finished sequences.

The scheduler holds only in-flight state: everything needed to continue a sequence (its token
ids, block table and computed tokens) is in the cache service. This module is the policy alone:
it talks to the cache through the `BlockCache` port (computesvc.cache_port: remote over gRPC in
the service, in-process in a benchmark), leaves which waiting requests get blocks to
computesvc.admission, hands each step's logits to computesvc.token_emitter (sampling, text,
streaming), and reports its events to a `SchedulerObserver` (computesvc.observer: counts, spans,
metrics).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.computesvc.admission import Admission
from kvtier.computesvc.cache_port import (
    AllocateItem,
    BlockCache,
    CacheUnavailable,
    ExceedsLimit,
    NoFreeBlocks,
    SequenceBlocks,
)
from kvtier.computesvc.model import ModelRunner, PrefillInput
from kvtier.computesvc.observer import SchedulerObserver
from kvtier.computesvc.paged_attention import LeaseExpired
from kvtier.computesvc.preemption import Ledger
from kvtier.computesvc.preemptor import Preemptor
from kvtier.computesvc.request import Request, Status, commit_items, mark_committed
from kvtier.computesvc.token_emitter import Picks, TokenEmitter

log = logging.getLogger("kvtier.compute")


def keep(queue: list[Request] | deque[Request], wanted: Callable[[Request], bool]) -> None:
    """Drop from `queue`, in place, the requests `wanted` refuses (the preemptor holds the same
    list and deques: they are never rebound)."""
    kept = [r for r in queue if wanted(r)]
    if len(kept) != len(queue):
        queue.clear()
        queue.extend(kept)


class StepFailed(Exception):
    """A scheduler step raised something unexpected: the requests in flight failed with it (INTERNAL)."""


def _public(error: Exception) -> str:
    """What every request of a failed step may be told of `error`: its text only when it names no
    one item of a batched call (the cache's per-item errors say `items[k]`, and may quote that
    request's salt or tokens); the replica's log has it all."""
    text = str(error)
    if "items[" in text:
        text = "a batched cache call refused one of its items (see the replica's log)"
    return f"{type(error).__name__}: {text}"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 2048  # prompt tokens prefilled per step (chunked beyond)
    # Slots reserved ahead of decoding sequences, in blocks. NOTE: 1 keeps KV waste under 4% and
    # still makes ~0.15 cache calls per decode step at batch 32 (bench/separation.py --stagger);
    # more blocks mean fewer calls and more reserved-but-unused slots.
    lookahead_blocks: int = 1
    admit_timeout_s: float = 60.0  # a request that finds no blocks this long fails with NoFreeBlocks
    preemption_policy: str = "cost"  # computesvc.preemption: "cost", or "newest" (the old rule)
    min_resident_steps: int = 4  # steps a sequence swapped in is not swapped out again (cost policy)
    max_preemptions: int = 3  # preemptions of one request before it is passed over (cost policy)
    # Blocks each tenant may hold (the api-keys file's max_blocks): a prompt over it fails at once.
    tenant_quotas: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: BlockCache,
        tokenizer,
        eos_token_ids: list[int],
        config: SchedulerConfig | None = None,
        observer: SchedulerObserver | None = None,
    ):
        self.runner = runner
        self.cache = cache
        self.config = config or SchedulerConfig()
        self.block_size = cache.block_size
        self.observer = observer or SchedulerObserver()
        self.emitter = TokenEmitter(tokenizer, eos_token_ids, self.observer)
        # Called when the cache service is lost (the replica re-attaches); default: fail in-flight requests.
        self.on_cache_lost: Callable[[Exception], None] = self.fail_all
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        # What the cost model remembers: measured rates, preemptions, swap-ins, host-tier room.
        self.ledger = Ledger()
        # Tenants whose own limit preempted one of their sequences or refused their Allocate ->
        # until when (monotonic s) their waiting requests are not admitted, unless one of their
        # sequences here finishes first (else the preempted one comes straight back and the
        # tenant's sequences take turns without finishing, or a refused request is retried every
        # step; its quota may be held by other replicas).
        self.held_back: dict[str, float] = {}
        self.admission = Admission(
            self.config, self._allocate, self._start, self.emitter, self.held_back, self.block_size
        )
        self.preemptor = Preemptor(
            config=self.config,
            observer=self.observer,
            ledger=self.ledger,
            call=self._call,
            running=self.running,
            waiting=self.waiting,
            swapped=self.swapped,
            held_back=self.held_back,
        )
        self.preemptor.attach(runner, cache)
        self._wakeup = asyncio.Event()
        # Whether a step (and so maybe a forward writing KV) is running; set when one ends.
        self._in_step = False
        self._step_ended = asyncio.Event()

    # ------------------------------------------------------------ entry points

    def attach(self, runner: ModelRunner, cache: BlockCache) -> None:
        """Run on a new attachment's pool and cache (the replica re-attached after losing its
        cache service or its lease); the requests in flight stay queued."""
        self.runner, self.cache = runner, cache
        self.preemptor.attach(runner, cache)

    def add(self, request: Request) -> None:
        if request.generator is None:
            request.generator = request.params.make_generator(self.runner.device)
        if request.output_token_ids:  # resumed after a failover: its text continues, not restarts
            self.emitter.resume(request)
        if (error := self._over_quota(request)) is not None:
            self.emitter.finish(request, "", error=error)
            return
        self.waiting.append(request)
        self._wakeup.set()

    def _over_quota(self, request: Request) -> ExceedsLimit | None:
        """ExceedsLimit if `request`'s tokens alone need more blocks than its tenant's quota: it
        can never fit, so it fails at once instead of queueing behind the tenant's others."""
        quota = self.config.tenant_quotas.get(request.tenant, 0)
        blocks = -(-request.num_tokens // self.block_size)
        if not quota or blocks <= quota:
            return None
        return ExceedsLimit(
            f"a {request.num_tokens}-token sequence needs {blocks} blocks but tenant {request.tenant!r} "
            f"may hold {quota} blocks (its quota): it can never fit; shorten the prompt"
        )

    def abort(self, request: Request) -> None:
        """The client went away: drop the request at the next step."""
        request.aborted = True
        self._wakeup.set()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    async def run_forever(self) -> None:
        while True:
            if not self.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                progressed = await self._stepped()
            except (CacheUnavailable, LeaseExpired) as e:
                self.on_cache_lost(e)
                continue
            except Exception as e:
                # NOTE: the loop must survive a bug or a cache error it does not expect: if this
                # task died, every request after it would wait forever on a live-looking replica.
                log.exception("scheduler step failed: failing the requests in flight")
                await self._abandon_all(StepFailed(f"scheduler step failed: {_public(e)}"))
                continue
            if not progressed:
                # Nothing could run (no blocks anywhere): let other replicas free some.
                await asyncio.sleep(0.01)

    async def _stepped(self) -> bool:
        """`step`, marked as running while it runs (`out_of_step`)."""
        self._in_step = True
        try:
            return await self.step()
        finally:
            self._in_step = False
            self._step_ended.set()

    async def out_of_step(self) -> None:
        """Return once no step is running (at once if none is): then no forward, and so no KV
        write, is in flight."""
        while self._in_step:
            self._step_ended.clear()
            await self._step_ended.wait()

    def fail_all(self, error: Exception) -> None:
        """Fail every in-flight request (the cache service went away: their blocks are gone)."""
        for req in [*self.waiting, *self.running, *self.swapped]:
            self.emitter.finish(req, "", error=error)
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()

    async def _abandon_all(self, error: Exception) -> None:
        """Fail every in-flight request and free its sequence, one call each (best effort: the
        failed batched call may be what broke)."""
        held = [r.sequence_id for r in [*self.running, *self.swapped]]
        self.fail_all(error)
        for sequence_id in held:
            try:
                await self._call(self.cache.free([sequence_id]))
            except Exception as e:  # the lease expiring releases it anyway
                log.warning("could not free sequence %d: %s", sequence_id, e)

    # ------------------------------------------------------------ one step

    async def step(self) -> bool:
        """One scheduling step; returns False when nothing could make progress."""
        self.ledger.step += 1
        await self._drop_aborted()
        with self.observer.step_span([*self.running, *self.swapped, *self.waiting]) as span:
            await self._resume_swapped()
            await self._admit()
            prefilled = await self._prefill()
            decoded = await self._decode()
            await self._release_finished()
            self.observer.on_step(span, len(self.running), len(self.waiting), len(self.swapped))
        return prefilled or decoded

    async def _call(self, coro, reqs: list[Request] = ()):
        """Await one BlockCache call (`coro`) made for `reqs`, counted under its method name (and
        traced in each request's own trace)."""
        self.observer.on_cache_call(coro.__name__)
        started = time.perf_counter()
        with self.observer.cache_call_span(coro.__name__, reqs):
            result = await coro
        if coro.__name__ in ("extend", "free", "commit"):  # calls that move no KV: the round trip
            self.ledger.rates.observe_call(time.perf_counter() - started)
        return result

    async def _drop_aborted(self) -> None:
        gone = [r for r in self.running + list(self.swapped) if r.aborted]
        keep(self.waiting, lambda r: not r.aborted)
        if gone:
            await self._call(self.cache.free([r.sequence_id for r in gone]), gone)
            for r in gone:
                r.status = Status.FINISHED
                self.held_back.pop(r.tenant, None)  # its blocks are free: its tenant may fit again
            # Drop only what was freed: a request aborted while the free was awaited still holds
            # its sequence, so it stays (running or swapped) and the next step frees it.
            freed = {id(r) for r in gone}
            keep(self.running, lambda r: id(r) not in freed)
            keep(self.swapped, lambda r: id(r) not in freed)

    async def _resume_swapped(self) -> None:
        if not self.swapped:
            # None of ours holds host slots: a refused SwapOut is worth trying again (others may
            # have freed theirs).
            self.ledger.host_has_room = True
            return
        if (
            self.running
            and self.config.preemption_policy == "cost"
            and not self.ledger.settled(self.config.min_resident_steps)
        ):
            return  # room was refused lately: a sequence swapped in now would be swapped out again
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            started = time.perf_counter()
            try:
                seq = (await self._call(self.cache.swap_in([req.sequence_id]), [req]))[0]
            except NoFreeBlocks:
                return
            self.ledger.rates.observe_swap(
                (len(seq.block_table) - req.num_released_blocks) * self.preemptor.block_bytes,
                time.perf_counter() - started,
            )
            self.ledger.swapped_in(req)
            self.swapped.popleft()
            req.block_table = seq.block_table
            req.status = Status.RUNNING
            self.running.append(req)
            log.debug("request %s swapped back in", req.request_id)

    async def _admit(self) -> None:
        """Allocate blocks for waiting requests (computesvc.admission), one batched call."""
        if self.swapped or not self.waiting:
            return  # swapped sequences go first: they already hold a place in the queue
        now = time.monotonic()
        held = {tenant for tenant, until in self.held_back.items() if until > now}
        await self.admission.admit(self.waiting, self.running, held)

    def _start(self, req: Request, seq: SequenceBlocks) -> None:
        """`req` got its blocks: it runs from the next prefill on."""
        req.sequence_id = seq.sequence_id
        req.block_table = seq.block_table
        req.num_computed = seq.num_cached_tokens
        req.num_committed = seq.num_cached_tokens
        req.num_recorded = req.num_tokens
        if req.num_cached_prompt_tokens < 0:
            # (A resumed request's hit may reach into its resumed output: the prompt's part.)
            req.num_cached_prompt_tokens = min(seq.num_cached_tokens, len(req.prompt_token_ids))
            self.observer.on_admitted(req, seq.num_cached_tokens)
        req.status = Status.RUNNING
        self.running.append(req)

    async def _allocate(self, batch: list[Request]) -> list[SequenceBlocks]:
        lookahead = self.config.lookahead_blocks * self.block_size
        max_len = self.cache.max_model_len
        items = [
            AllocateItem(
                r.token_ids,
                tenant_salt=r.tenant_salt,
                num_lookahead_tokens=max(0, min(lookahead, max_len - r.num_tokens)),
                tenant=r.tenant,
            )
            for r in batch
        ]
        return await self._call(self.cache.allocate(items), batch)

    # ------------------------------------------------------------ prefill

    async def _prefill(self) -> bool:
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[Request, int]] = []
        for req in self.running:
            if not req.prefilling or budget <= 0:
                continue
            # The last prompt token is prefilled too: its logits give the first completion token.
            n = min(req.num_tokens - req.num_computed, budget)
            chunks.append((req, n))
            budget -= n
        if not chunks:
            return False
        inputs = [
            PrefillInput(
                req.token_ids[req.num_computed : req.num_computed + n], req.num_computed, req.block_table
            )
            for req, n in chunks
        ]
        # The chunks that finish their prompt: their logits give the first completion tokens.
        done = [(req, i) for i, (req, n) in enumerate(chunks) if req.num_computed + n == req.num_tokens]
        rows = torch.tensor([i for _, i in done], dtype=torch.long)

        def forward() -> Picks | None:
            logits = self.runner.prefill(inputs)
            return (
                self.emitter.pick([r for r, _ in done], logits.index_select(0, rows.to(logits.device)))
                if done
                else None
            )

        started = time.perf_counter()
        with self.observer.prefill_span(chunks):
            picks = await asyncio.get_running_loop().run_in_executor(self.runner.executor, forward)
        self.ledger.rates.observe_prefill(sum(n for _, n in chunks), time.perf_counter() - started)
        for req, n in chunks:
            req.num_computed += n
        if done:
            # Publish the prompts before their first tokens go out: a request that starts when it
            # sees one (the other n choices of a prompt, a client's next turn) then hits them.
            await self._commit([r for r, _ in done])
            self.emitter.deliver([r for r, _ in done], picks, self.cache.max_model_len)
        return True

    # ------------------------------------------------------------ decode

    async def _decode(self) -> bool:
        decoding = [
            r for r in self.running if not r.prefilling and r.status is Status.RUNNING and not self._done(r)
        ]
        if not decoding:
            return False
        await self.preemptor.reserve_slots(decoding)
        # A sequence left without a slot (it waits for room) sits this step out.
        decoding = [r for r in decoding if r.status is Status.RUNNING and self.preemptor.has_slot(r)]
        if not decoding:
            return False
        tokens = [r.token_at(r.num_computed) for r in decoding]
        positions = [r.num_computed for r in decoding]
        tables = [r.block_table for r in decoding]

        def forward() -> Picks:
            # Sampled on the forward thread too (TokenEmitter.pick: one OpenMP team for every op).
            return self.emitter.pick(decoding, self.runner.decode(tokens, positions, tables))

        started = time.perf_counter()
        with self.observer.decode_span(decoding):
            picks = await asyncio.get_running_loop().run_in_executor(self.runner.executor, forward)
        self.ledger.rates.observe_decode(time.perf_counter() - started)
        for req in decoding:
            req.num_computed += 1
        self.observer.on_decode_step()
        self.emitter.deliver(decoding, picks, self.cache.max_model_len)
        return True

    async def _commit(self, reqs: list[Request]) -> None:
        """Report computed tokens (and append their ids to the cache's records) in a Commit of
        its own: only for prompts just prefilled, whose blocks must be published before their
        first token goes out. Every other commit rides on an Extend, Free or SwapOut."""
        items = commit_items(reqs)
        if not items:
            return
        await self._call(self.cache.commit(items), reqs)
        mark_committed(reqs)

    # ------------------------------------------------------------ release

    @staticmethod
    def _done(req: Request) -> bool:
        return req.status is Status.FINISHED

    async def _release_finished(self) -> None:
        done = [r for r in self.running if r.status is Status.FINISHED]
        if not done:
            return
        # The last sampled token has no KV: commit what was computed, so the whole
        # conversation so far is a prefix hit for the next turn, and free, in one call.
        await self._call(self.cache.free([r.sequence_id for r in done], commit_items(done)), done)
        mark_committed(done)
        for tenant in {r.tenant for r in done}:
            self.held_back.pop(tenant, None)
        # NOTE: dropped from `running` only once freed: if a call fails, _abandon_all frees them.
        keep(self.running, lambda r: r.status is not Status.FINISHED)
