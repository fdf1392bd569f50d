"""Continuous batching over the cache service's blocks.

One asyncio task runs `step()` in a loop. A step:

1. resumes swapped-out sequences (`SwapIn`), then admits waiting requests with one batched
   `Allocate` (prefix hits skip prefill of their cached part);
2. prefills the uncached tokens of new sequences, chunked by the token budget, and commits
   the finished prompts so other requests can hit them at once;
3. tops up the reserved slots of decoding sequences when one runs out (`Commit` + `Extend`
   for every sequence below the low-water mark, so most steps make no cache call), preempting
   the newest sequence on RESOURCE_EXHAUSTED (`SwapOut`, or recompute when the host tier is full);
4. runs one batched decode forward for all running sequences and streams their tokens;
5. commits and frees finished sequences.

The scheduler holds only in-flight state: everything needed to continue a sequence (its token
ids, block table and computed tokens) is in the cache service. It talks to the cache through a
`BlockCache` (remote over gRPC in the service, in-process in a benchmark) and never imports gRPC.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from opentelemetry import trace

from computesvc.model import LeaseExpired, ModelRunner, PrefillInput
from computesvc.sampling import Sampler, SamplingParams
from kvtier import telemetry

log = logging.getLogger("kvtier.compute")


# ---------------------------------------------------------------- the cache, as the scheduler sees it


class NoFreeBlocks(Exception):
    """The cache has no room for this call (RESOURCE_EXHAUSTED): preempt or wait."""


class CacheUnavailable(Exception):
    """The cache service cannot be reached (or restarted and forgot our lease): retryable."""


class StepFailed(Exception):
    """A scheduler step raised something unexpected: the requests in flight failed with it (INTERNAL)."""


@dataclass(slots=True)
class SeqBlocks:
    sequence_id: int
    block_table: list[int]
    num_cached_tokens: int = 0


class BlockCache(Protocol):
    """The calls the scheduler makes. Every method is batched and all-or-nothing."""

    block_size: int
    max_model_len: int

    async def allocate(
        self, prompts: list[list[int]], salts: list[str], lookahead: list[int]
    ) -> list[SeqBlocks]: ...
    async def extend(self, items: list[tuple[int, int]]) -> list[SeqBlocks]: ...
    async def commit(self, items: list[tuple[int, list[int], int]]) -> None: ...
    async def free(self, sequence_ids: list[int]) -> None: ...
    async def swap_out(self, sequence_ids: list[int]) -> int: ...  # bytes moved
    async def swap_in(self, sequence_ids: list[int]) -> list[SeqBlocks]: ...


# ---------------------------------------------------------------- requests


class Status(enum.Enum):
    WAITING = "waiting"  # not allocated (new, or preempted for recompute)
    RUNNING = "running"  # blocks on the device; prefilling or decoding
    SWAPPED = "swapped"  # blocks in the host tier
    FINISHED = "finished"


@dataclass
class StepOutput:
    """What one step produced for one request (the servicer turns it into a GenerateResponse)."""

    token_ids: list[int]
    text: str
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    time_to_first_token_s: float = 0.0
    error: Exception | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""
    arrival: float = field(default_factory=time.monotonic)
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    generator: torch.Generator | None = None
    # The span context of the request's server span: batched prefill/decode spans link to it.
    span_context: trace.SpanContext | None = None

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    sequence_id: int = 0
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in the pool
    num_recorded: int = 0  # leading tokens the cache's sequence record holds
    num_committed: int = 0  # num_computed last reported to the cache
    num_cached_prompt_tokens: int = -1  # from the first Allocate; -1 = not allocated yet
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    text: str = ""  # completion text streamed so far
    aborted: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefilling(self) -> bool:
        # Decoding means: every token but the last sampled one is in the pool.
        return self.num_computed < self.num_tokens - 1


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 2048  # prompt tokens prefilled per step (chunked beyond)
    # Slots reserved ahead of decoding sequences, in blocks. NOTE: 1 keeps KV waste under 4% and
    # still makes ~0.15 cache calls per decode step at batch 32 (bench/separation.py --stagger);
    # more blocks mean fewer calls and more reserved-but-unused slots.
    lookahead_blocks: int = 1
    admit_timeout_s: float = 60.0  # a request that finds no blocks this long fails with NoFreeBlocks


@dataclass
class SchedulerStats:
    steps: int = 0
    decode_steps: int = 0
    cache_calls: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: BlockCache,
        tokenizer,
        eos_token_ids: list[int],
        config: SchedulerConfig | None = None,
        metrics=None,
    ):
        self.runner = runner
        self.cache = cache
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.config = config or SchedulerConfig()
        self.block_size = cache.block_size
        self.sampler = Sampler()
        self.stats = SchedulerStats()
        self.metrics = metrics  # computesvc.metrics.ComputeMetrics, or None
        # Called when the cache service is lost (the replica re-attaches); default: fail in-flight requests.
        self.on_cache_lost: Callable[[Exception], None] = self.fail_all
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self._wakeup = asyncio.Event()
        self._ids = itertools.count(1)
        self._tracer = telemetry.tracer("kvtier.compute.scheduler")

    # ------------------------------------------------------------ entry points

    def add(self, request: Request) -> None:
        if request.generator is None:
            request.generator = request.params.make_generator(self.runner.device)
        self.waiting.append(request)
        self._wakeup.set()

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
                progressed = await self.step()
            except (CacheUnavailable, LeaseExpired) as e:
                self.on_cache_lost(e)
                continue
            except Exception as e:
                # NOTE: the loop must survive a bug or a cache error it does not expect: if this
                # task died, every request after it would wait forever on a live-looking replica.
                log.exception("scheduler step failed: failing the requests in flight")
                await self._abandon_all(StepFailed(f"scheduler step failed: {type(e).__name__}: {e}"))
                continue
            if not progressed:
                # Nothing could run (no blocks anywhere): let other replicas free some.
                await asyncio.sleep(0.01)

    def fail_all(self, error: Exception) -> None:
        """Fail every in-flight request (the cache service went away: their blocks are gone)."""
        for req in [*self.waiting, *self.running, *self.swapped]:
            self._finish(req, "", error=error)
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
        self.stats.steps += 1
        await self._drop_aborted()
        with self._tracer.start_as_current_span("scheduler.step", context=self._step_context()) as span:
            await self._resume_swapped()
            await self._admit()
            prefilled = await self._prefill()
            decoded = await self._decode()
            await self._release_finished()
            span.set_attribute("kvtier.running", len(self.running))
            span.set_attribute("kvtier.waiting", len(self.waiting))
            span.set_attribute("kvtier.swapped", len(self.swapped))
        if self.metrics is not None:
            self.metrics.running_sequences.set(len(self.running))
            self.metrics.waiting_sequences.set(len(self.waiting) + len(self.swapped))
        return prefilled or decoded

    def _step_context(self):
        """Parent of a step span: the oldest request in flight, so a lone request's trace holds
        its steps and their cache calls; the requests a step serves are linked from its spans."""
        oldest = next((r for r in [*self.running, *self.swapped, *self.waiting] if r.span_context), None)
        if oldest is None or not oldest.span_context.is_valid:
            return None
        return trace.set_span_in_context(trace.NonRecordingSpan(oldest.span_context))

    async def _call(self, coro):
        self.stats.cache_calls += 1
        if self.metrics is not None:
            self.metrics.cache_calls.labels(coro.__name__).inc()
        return await coro

    async def _drop_aborted(self) -> None:
        gone = [r for r in self.running + list(self.swapped) if r.aborted]
        self.waiting = deque(r for r in self.waiting if not r.aborted)
        if gone:
            await self._call(self.cache.free([r.sequence_id for r in gone]))
            for r in gone:
                r.status = Status.FINISHED
            self.running = [r for r in self.running if not r.aborted]
            self.swapped = deque(r for r in self.swapped if not r.aborted)

    async def _resume_swapped(self) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            try:
                seq = (await self._call(self.cache.swap_in([req.sequence_id])))[0]
            except NoFreeBlocks:
                return
            self.swapped.popleft()
            req.block_table = seq.block_table
            req.status = Status.RUNNING
            self.running.append(req)
            log.debug("request %s swapped back in", req.request_id)

    async def _admit(self) -> None:
        """Allocate blocks for waiting requests (FCFS), one batched call."""
        if self.swapped or not self.waiting:
            return  # swapped sequences go first: they already hold a place in the queue
        room = self.config.max_num_seqs - len(self.running)
        budget = self.config.max_num_batched_tokens
        batch: list[Request] = []
        for req in self.waiting:
            if len(batch) >= room or (batch and req.num_tokens > budget):
                break
            batch.append(req)
            budget -= req.num_tokens
        while batch:
            try:
                seqs = await self._allocate(batch)
                break
            except NoFreeBlocks:
                if len(batch) == 1:
                    self._expire_stuck(batch[0])
                    return
                batch = batch[: len(batch) // 2]
        for req, seq in zip(batch, seqs, strict=True):
            self.waiting.popleft()
            req.sequence_id = seq.sequence_id
            req.block_table = seq.block_table
            req.num_computed = seq.num_cached_tokens
            req.num_committed = seq.num_cached_tokens
            req.num_recorded = req.num_tokens
            if req.num_cached_prompt_tokens < 0:
                req.num_cached_prompt_tokens = seq.num_cached_tokens
                self.stats.prompt_tokens += len(req.prompt_token_ids)
                self.stats.cached_prompt_tokens += seq.num_cached_tokens
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
                    self.metrics.cached_prompt_tokens.inc(seq.num_cached_tokens)
            req.status = Status.RUNNING
            self.running.append(req)

    async def _allocate(self, batch: list[Request]) -> list[SeqBlocks]:
        lookahead = self.config.lookahead_blocks * self.block_size
        max_len = self.cache.max_model_len
        return await self._call(
            self.cache.allocate(
                [r.token_ids for r in batch],
                [r.cache_salt for r in batch],
                [max(0, min(lookahead, max_len - r.num_tokens)) for r in batch],
            )
        )

    def _expire_stuck(self, req: Request) -> None:
        if not self.running and time.monotonic() - req.arrival > self.config.admit_timeout_s:
            self.waiting.remove(req)
            self._finish(
                req,
                "",
                error=NoFreeBlocks(
                    f"no KV blocks for a {req.num_tokens}-token sequence after "
                    f"{self.config.admit_timeout_s:.0f}s: the pool is too small or held by other replicas"
                ),
            )

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
        with self._tracer.start_as_current_span("prefill", links=_links(r for r, _ in chunks)) as span:
            span.set_attribute("kvtier.num_seqs", len(chunks))
            span.set_attribute("kvtier.prefill_tokens", sum(n for _, n in chunks))
            logits = await asyncio.get_running_loop().run_in_executor(None, self.runner.prefill, inputs)
        done: list[tuple[Request, int]] = []
        for i, (req, n) in enumerate(chunks):
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                done.append((req, i))
        if done:
            rows = torch.tensor([i for _, i in done])
            self._sample_and_emit([r for r, _ in done], logits.index_select(0, rows))
            # Publish the prompts now so a concurrent request with the same prefix hits them.
            await self._commit([r for r, _ in done])
        return True

    # ------------------------------------------------------------ decode

    async def _decode(self) -> bool:
        decoding = [
            r for r in self.running if not r.prefilling and r.status is Status.RUNNING and not self._done(r)
        ]
        if not decoding:
            return False
        await self._reserve_slots(decoding)
        decoding = [r for r in decoding if r.status is Status.RUNNING]
        if not decoding:
            return False
        with self._tracer.start_as_current_span("decode", links=_links(decoding)) as span:
            span.set_attribute("kvtier.batch_size", len(decoding))
            logits = await asyncio.get_running_loop().run_in_executor(
                None,
                self.runner.decode,
                [r.token_ids[r.num_computed] for r in decoding],
                [r.num_computed for r in decoding],
                [r.block_table for r in decoding],
            )
        for req in decoding:
            req.num_computed += 1
        self.stats.decode_steps += 1
        if self.metrics is not None:
            self.metrics.decode_steps.inc()
        self._sample_and_emit(decoding, logits)
        return True

    def _slots(self, req: Request) -> int:
        return len(req.block_table) * self.block_size

    async def _reserve_slots(self, decoding: list[Request]) -> None:
        """Make sure each decoding sequence has a slot for this step's token.

        NOTE: called rarely on purpose. When one sequence runs out, every sequence below one
        block of headroom is topped up to `lookahead_blocks` in the same call, so with a batch
        in flight most steps make no cache call at all.
        """
        if all(self._slots(r) > r.num_computed for r in decoding):
            return
        low = [r for r in decoding if self._slots(r) - r.num_computed <= self.block_size]
        while low:
            await self._commit(low)
            lookahead = self.config.lookahead_blocks * self.block_size
            max_len = self.cache.max_model_len
            items = [(r.sequence_id, max(1, min(lookahead, max_len - r.num_recorded))) for r in low]
            try:
                seqs = await self._call(self.cache.extend(items))
            except NoFreeBlocks:
                victim = await self._preempt()
                if victim is None:
                    return
                low = [r for r in low if r is not victim]
                continue
            for req, seq in zip(low, seqs, strict=True):
                req.block_table = seq.block_table
            return

    async def _preempt(self) -> Request | None:
        """Preempt the newest running sequence: swap it out, or free it to recompute later."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda r: r.arrival)
        await self._commit([victim])
        with self._tracer.start_as_current_span("preempt") as span:
            span.set_attribute("kvtier.request_id", victim.request_id)
            try:
                moved = await self._call(self.cache.swap_out([victim.sequence_id]))
                # NOTE: it leaves `running` only once the cache took it: if a call fails,
                # _abandon_all still finds (and frees) its sequence.
                self.running.remove(victim)
                victim.status = Status.SWAPPED
                self.swapped.append(victim)
                self.stats.preemptions_swap += 1
                if self.metrics is not None:
                    self.metrics.preemptions.labels("swap").inc()
                span.set_attribute("kvtier.swap_bytes", moved)
                span.set_attribute("kvtier.preemption", "swap")
                log.info("preempted request %s: swapped out (%d bytes)", victim.request_id, moved)
            except NoFreeBlocks:
                # Host tier full: drop the blocks; the committed ones stay cached, so recompute
                # of this sequence is mostly prefix hits.
                await self._call(self.cache.free([victim.sequence_id]))
                self.running.remove(victim)
                victim.status = Status.WAITING
                victim.block_table = []
                self.waiting.appendleft(victim)
                self.stats.preemptions_recompute += 1
                if self.metrics is not None:
                    self.metrics.preemptions.labels("recompute").inc()
                span.set_attribute("kvtier.preemption", "recompute")
                log.info("preempted request %s: will recompute (host tier full)", victim.request_id)
        return victim

    async def _commit(self, reqs: list[Request]) -> None:
        """Report computed tokens (and append their ids to the cache's records)."""
        items = []
        for req in reqs:
            if req.num_computed > req.num_committed:
                new_ids = req.token_ids[req.num_recorded : req.num_computed]
                items.append((req.sequence_id, new_ids, req.num_computed))
        if not items:
            return
        await self._call(self.cache.commit(items))
        for req in reqs:
            req.num_recorded = max(req.num_recorded, req.num_computed)
            req.num_committed = req.num_computed

    # ------------------------------------------------------------ sampling and output

    def _sample_and_emit(self, reqs: list[Request], logits: torch.Tensor) -> None:
        tokens = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        now = time.monotonic()
        for req, token in zip(reqs, tokens, strict=True):
            req.output_token_ids.append(token)
            self.stats.generated_tokens += 1
            ttft = 0.0
            if not req.first_token_at:
                req.first_token_at = now
                ttft = now - req.arrival
                if self.metrics is not None:
                    self.metrics.time_to_first_token.observe(ttft)
            elif self.metrics is not None:
                self.metrics.inter_token_latency.observe(now - req.last_token_at)
            req.last_token_at = now
            if self.metrics is not None:
                self.metrics.generation_tokens.inc()
            reason, text = self._check_stop(req, token)
            if reason:
                self._finish(req, reason, text=text, token_ids=[token], ttft=ttft)
            else:
                req.outputs.put_nowait(StepOutput([token], text, time_to_first_token_s=ttft))

    def _check_stop(self, req: Request, token: int) -> tuple[str, str]:
        """(finish reason or "", new text to stream)."""
        p = req.params
        full = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        # Hold back an incomplete UTF-8 sequence: it decodes to U+FFFD until its last byte arrives.
        stable = full[:-1] if full.endswith("\ufffd") else full
        reason = ""
        for stop in p.stop:
            at = stable.find(stop, max(0, len(req.text) - len(stop)))
            if at >= 0:
                stable, reason = stable[:at], "stop"
                break
        if not reason:
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                reason, stable = "stop", full
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.cache.max_model_len:
                reason, stable = "length", full
        delta = stable[len(req.text) :] if stable.startswith(req.text) else stable
        req.text = stable if stable.startswith(req.text) else req.text + delta
        return reason, delta

    @staticmethod
    def _done(req: Request) -> bool:
        return req.status is Status.FINISHED

    def _finish(
        self,
        req: Request,
        reason: str,
        *,
        text: str = "",
        token_ids: list[int] | None = None,
        ttft: float = 0.0,
        error: Exception | None = None,
    ) -> None:
        req.status = Status.FINISHED
        out = StepOutput(
            token_ids=token_ids or [],
            text=text,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=len(req.output_token_ids),
            cached_prompt_tokens=max(0, req.num_cached_prompt_tokens),
            time_to_first_token_s=ttft,
            error=error,
        )
        req.outputs.put_nowait(out)
        if self.metrics is not None:
            self.metrics.finished_requests.labels(reason or "error").inc()

    async def _release_finished(self) -> None:
        done = [r for r in self.running if r.status is Status.FINISHED]
        if not done:
            return
        # The last sampled token has no KV: commit what was computed, so the whole
        # conversation so far is a prefix hit for the next turn, then free.
        await self._commit(done)
        await self._call(self.cache.free([r.sequence_id for r in done]))
        # NOTE: dropped from `running` only once freed: if a call fails, _abandon_all frees them.
        self.running = [r for r in self.running if r.status is not Status.FINISHED]


def _links(reqs) -> list[trace.Link]:
    """Links from a batched span to the requests it served (one span per step, not per request)."""
    return [
        trace.Link(r.span_context, {"kvtier.request_id": r.request_id})
        for r in reqs
        if r.span_context is not None and r.span_context.is_valid
    ]


def new_request_id(counter=itertools.count(1)) -> str:
    return f"req-{int(time.time() * 1000) % 10**9:09d}-{next(counter)}"
