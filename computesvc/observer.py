"""What the scheduler reports: counts, spans, logs and (when enabled) Prometheus metrics.

The scheduler calls one `SchedulerObserver` at each of its events and never checks whether
metrics are on: the base class counts into `SchedulerStats` and traces (spans cost nothing when
tracing is off); `MetricsObserver` also updates a replica's `ComputeMetrics`.

Traces have two views of the same work. The batched spans (`scheduler.step` and, under it,
`batch.prefill`, `batch.decode`, `preempt` and the cache RPCs) are the step's, parented by the
oldest request in flight and linked to every request they served. Each request's own trace (under
its `Generate` server span) has its share: a `prefill` span (an event a chunk), `decode` spans (an
event a step; a new span after a preemption or every `DECODE_EVENTS_PER_SPAN` steps) and a
`cache.<Method>` span for every cache call made for it (whichever call carried its commit), each
linked to the batched span that did the work; the cache service's span for its share of the call
is that span's child (``telemetry.for_requests``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import trace

from kvtier import telemetry
from kvtier.computesvc.preemption import RECOMPUTE, RECOMPUTE_BECAUSE, SWAP, Decision
from kvtier.computesvc.request import Request, Status

if TYPE_CHECKING:
    from kvtier.computesvc.metrics import ComputeMetrics

log = logging.getLogger("kvtier.compute")

# A request's decode span ends after this many steps and the next begins (events per span stay
# under the SDK's default limit of 128, so none is dropped).
DECODE_EVENTS_PER_SPAN = 100


@dataclass
class SchedulerStats:
    """Counts since the scheduler started (benchmarks read them; metrics export the same events)."""

    steps: int = 0
    decode_steps: int = 0
    cache_calls: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    # (reason, mode) -> preemptions (computesvc.preemption's REASONS; mode as done, not as chosen).
    preemptions_by_reason: dict[tuple[str, str], int] = field(default_factory=dict)
    # Why each victim freed to recompute was not swapped out (computesvc.preemption's RECOMPUTE_BECAUSE).
    recomputed_because: dict[str, int] = field(default_factory=dict)
    preemptions_deferred: int = 0  # times every candidate was guarded and the refused ones waited
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0


def recompute_because(decision: Decision) -> str:
    """Why the victim of `decision` was freed rather than swapped out (a RECOMPUTE_BECAUSE key):
    the decision's own reason, or the host tier's refusal of the swap it chose."""
    return decision.because if decision.mode == RECOMPUTE else "host_refused"


def _links(reqs: Iterable[Request]) -> list[trace.Link]:
    """Links from a batched span to the requests it served (one span per step, not per request)."""
    return [
        trace.Link(r.span_context, {"kvtier.request_id": r.request_id})
        for r in reqs
        if r.span_context is not None and r.span_context.is_valid
    ]


def _step_context(in_flight: Iterable[Request]):
    """Parent of a step span: the oldest request in flight, so a lone request's trace holds
    its steps and their cache calls; the requests a step serves are linked from its spans."""
    oldest = next((r for r in in_flight if r.span_context), None)
    if oldest is None or not oldest.span_context.is_valid:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(oldest.span_context))


def _method(name: str) -> str:
    """The RPC name of a BlockCache method: swap_out -> SwapOut."""
    return "".join(part.title() for part in name.split("_"))


@dataclass
class _RequestSpans:
    """The spans open in one request's own trace."""

    context: object  # the request's server span, as a parent context
    prefill: trace.Span | None = None
    decode: trace.Span | None = None
    decode_steps: int = 0  # events on `decode`

    def end(self, event: str = "") -> None:
        for span in (self.prefill, self.decode):
            if span is not None:
                if event:
                    span.add_event(event)
                span.end()
        self.prefill = self.decode = None


class SchedulerObserver:
    """Counts and traces the scheduler's events; exports no metrics."""

    def __init__(self) -> None:
        self.stats = SchedulerStats()
        self._tracer = telemetry.tracer("kvtier.compute.scheduler")
        # Requests with spans open in their own traces (only while tracing is on).
        self._traced: dict[Request, _RequestSpans] = {}

    # ------------------------------------------------------------ spans (context managers)

    def step_span(self, in_flight: list[Request]):
        """Counts a step and opens its span; `in_flight`: running, swapped, then waiting requests."""
        self.stats.steps += 1
        self._end_finished()  # those failed between steps (the cache service lost, a failed step)
        return self._tracer.start_as_current_span("scheduler.step", context=_step_context(in_flight))

    def _of(self, req: Request) -> _RequestSpans | None:
        """The request's spans, None when tracing is off or it has no trace of its own."""
        spans = self._traced.get(req)
        if spans is None and telemetry.tracing_enabled() and req.span_context is not None:
            if not req.span_context.is_valid:
                return None
            parent = trace.set_span_in_context(trace.NonRecordingSpan(req.span_context))
            spans = self._traced[req] = _RequestSpans(parent)
        return spans

    def _request_span(self, name: str, req: Request, batch: trace.Span, **attributes) -> trace.Span:
        """A span in `req`'s own trace, linked to the batched span `batch` that does its work."""
        links = [trace.Link(batch.get_span_context())] if batch.get_span_context().is_valid else []
        return self._tracer.start_span(
            name,
            context=self._traced[req].context,
            links=links,
            attributes={"kvtier.request_id": req.request_id, **attributes},
        )

    @contextlib.contextmanager
    def prefill_span(self, chunks: list[tuple[Request, int]]) -> Iterator[trace.Span]:
        """The span of one batched prefill forward; `chunks`: (request, tokens prefilled). Each
        request's `prefill` span gets an event for its chunk, and ends with its prompt's last chunk."""
        with self._tracer.start_as_current_span(
            "batch.prefill",
            links=_links(r for r, _ in chunks),
            attributes={"kvtier.num_seqs": len(chunks), "kvtier.prefill_tokens": sum(n for _, n in chunks)},
        ) as batch:
            mine = [(req, n, spans) for req, n in chunks if (spans := self._of(req)) is not None]
            for req, n, spans in mine:
                if spans.prefill is None:
                    spans.prefill = self._request_span(
                        "prefill", req, batch, **{"kvtier.prompt_tokens": len(req.prompt_token_ids)}
                    )
                    spans.prefill.set_attribute("kvtier.cached_tokens", req.num_computed)
                spans.prefill.add_event(
                    "chunk",
                    {"kvtier.position": req.num_computed, "kvtier.tokens": n, "kvtier.num_seqs": len(chunks)},
                )
            ok = False
            try:
                yield batch
                ok = True
            finally:
                for req, n, spans in mine:
                    if spans.prefill is not None and (not ok or req.num_computed + n >= req.num_tokens):
                        if not ok:
                            spans.prefill.set_status(trace.StatusCode.ERROR, "prefill forward failed")
                        spans.prefill.end()
                        spans.prefill = None

    @contextlib.contextmanager
    def decode_span(self, reqs: list[Request]) -> Iterator[trace.Span]:
        """The span of one batched decode forward over `reqs`; an event on each request's `decode` span."""
        with self._tracer.start_as_current_span(
            "batch.decode", links=_links(reqs), attributes={"kvtier.batch_size": len(reqs)}
        ) as batch:
            for req in reqs if telemetry.tracing_enabled() else ():
                spans = self._of(req)
                if spans is None:
                    continue
                if spans.decode is not None and spans.decode_steps >= DECODE_EVENTS_PER_SPAN:
                    spans.decode.end()
                    spans.decode = None
                if spans.decode is None:
                    spans.decode = self._request_span("decode", req, batch)
                    spans.decode_steps = 0
                spans.decode.add_event(
                    "step", {"kvtier.position": req.num_computed, "kvtier.batch_size": len(reqs)}
                )
                spans.decode_steps += 1
            yield batch

    def preempt_span(self, victim: Request, decision: Decision):
        """The span of preempting `victim` as `decision` says (its inputs are the span's
        attributes); the victim's own trace's open spans end (a new phase follows)."""
        if (spans := self._traced.get(victim)) is not None:
            spans.end("preempted")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("preempting request %s: %s", victim.request_id, decision.describe())
        return self._tracer.start_as_current_span(
            "preempt",
            links=_links([victim]),
            attributes={"kvtier.request_id": victim.request_id, **decision.attributes()},
        )

    @contextlib.contextmanager
    def cache_call_span(self, method: str, reqs: Iterable[Request]) -> Iterator[None]:
        """Around one BlockCache call made for `reqs`: a `cache.<Method>` span in each request's
        own trace (the RPC itself is traced once, under the current step), linked to the step."""
        mine = [(req, spans) for req in reqs if (spans := self._of(req)) is not None]
        if not mine:
            yield
            return
        step = trace.get_current_span()
        name = f"cache.{_method(method)}"
        opened = []
        for req, _ in mine:
            attributes = {"rpc.method": _method(method), "kvtier.batch_size": len(mine)}
            if req.sequence_id:
                attributes["kvtier.sequence_id"] = req.sequence_id
            if req.num_computed > req.num_committed:  # the call carries this request's commit
                attributes["kvtier.commit_tokens"] = req.num_computed - req.num_committed
            opened.append(self._request_span(name, req, step, **attributes))
        with (
            telemetry.ending(opened),
            telemetry.for_requests(opened),
        ):  # the RPC names them: the cache traces each
            yield

    def _end_finished(self) -> None:
        """End the open spans of requests that finished (or failed), or were aborted (one dropped
        from the waiting queue never becomes FINISHED)."""
        for req in [r for r in self._traced if r.status is Status.FINISHED or r.aborted]:
            self._traced.pop(req).end()

    # ------------------------------------------------------------ events

    def on_step(self, span: trace.Span, running: int, waiting: int, swapped: int) -> None:
        """A step ended with this many sequences in each queue."""
        self._end_finished()
        span.set_attribute("kvtier.running", running)
        span.set_attribute("kvtier.waiting", waiting)
        span.set_attribute("kvtier.swapped", swapped)

    def on_cache_call(self, method: str) -> None:
        """The scheduler calls the BlockCache's `method` (allocate, extend, ...)."""
        self.stats.cache_calls += 1

    def on_admitted(self, req: Request, num_cached_tokens: int) -> None:
        """`req` got its first blocks; `num_cached_tokens` of its prompt were prefix hits."""
        self.stats.prompt_tokens += len(req.prompt_token_ids)
        self.stats.cached_prompt_tokens += num_cached_tokens

    def on_token(self, first: bool, latency_s: float) -> None:
        """A token was sampled: `latency_s` since the request arrived if it is the request's
        first token, else since its previous token."""
        self.stats.generated_tokens += 1

    def on_decode_step(self) -> None:
        self.stats.decode_steps += 1

    def on_preempted(
        self, span: trace.Span, victim: Request, swapped_bytes: int | None, decision: Decision
    ) -> None:
        """`victim` was swapped out (`swapped_bytes` moved), or freed to recompute (None), as
        `decision` chose (a swap the host tier refused became a recompute)."""
        key = (decision.reason, RECOMPUTE if swapped_bytes is None else SWAP)
        self.stats.preemptions_by_reason[key] = self.stats.preemptions_by_reason.get(key, 0) + 1
        if swapped_bytes is None:
            self.stats.preemptions_recompute += 1
            because = recompute_because(decision)
            self.stats.recomputed_because[because] = self.stats.recomputed_because.get(because, 0) + 1
            span.set_attribute("kvtier.preemption", "recompute")
            log.info(
                "preempted request %s (%s): will recompute (%s)",
                victim.request_id,
                decision.reason,
                RECOMPUTE_BECAUSE[because],
            )
        else:
            self.stats.preemptions_swap += 1
            span.set_attribute("kvtier.swap_bytes", swapped_bytes)
            span.set_attribute("kvtier.preemption", "swap")
            log.info(
                "preempted request %s (%s): swapped out (%d bytes)",
                victim.request_id,
                decision.reason,
                swapped_bytes,
            )

    def on_preemption_deferred(self, candidates: int) -> None:
        """No sequence was preempted: all `candidates` were guarded against thrash and another
        can still run, so the sequences short of room wait."""
        self.stats.preemptions_deferred += 1

    def on_finished(self, reason: str) -> None:
        """A request finished with `reason` ("stop", "length"; "" when it failed)."""


class MetricsObserver(SchedulerObserver):
    """Also exports the events as a replica's Prometheus metrics."""

    def __init__(self, metrics: ComputeMetrics) -> None:
        super().__init__()
        self.metrics = metrics
        # Admitted requests not finished yet -> when their first Allocate answered (monotonic s).
        self._admitted: dict[Request, float] = {}

    def on_step(self, span: trace.Span, running: int, waiting: int, swapped: int) -> None:
        super().on_step(span, running, waiting, swapped)
        self.metrics.running_sequences.set(running)
        self.metrics.waiting_sequences.set(waiting + swapped)
        self._observe_finished()  # those aborted by their client finish without on_finished

    def _observe_finished(self) -> None:
        """The per-request histograms of every admitted request that has finished (vLLM's
        definitions, computesvc/metrics.py); a request failed before admission has none."""
        now = time.monotonic()
        m = self.metrics
        for req in [r for r in self._admitted if r.status is Status.FINISHED]:
            admitted_at = self._admitted.pop(req)
            last = req.last_token_at or now
            m.e2e_request_latency.observe(now - req.arrival)
            m.request_queue_time.observe(admitted_at - req.arrival)
            m.request_inference_time.observe(last - admitted_at)
            if req.first_token_at:
                m.request_prefill_time.observe(req.first_token_at - admitted_at)
                m.request_decode_time.observe(req.last_token_at - req.first_token_at)
            m.request_prompt_tokens.observe(len(req.prompt_token_ids))
            m.request_generation_tokens.observe(len(req.output_token_ids))

    def on_cache_call(self, method: str) -> None:
        super().on_cache_call(method)
        self.metrics.cache_calls.labels(method).inc()

    def on_admitted(self, req: Request, num_cached_tokens: int) -> None:
        super().on_admitted(req, num_cached_tokens)
        self._admitted[req] = time.monotonic()
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        self.metrics.cached_prompt_tokens.inc(num_cached_tokens)

    def on_token(self, first: bool, latency_s: float) -> None:
        super().on_token(first, latency_s)
        if first:
            self.metrics.time_to_first_token.observe(latency_s)
        else:
            self.metrics.inter_token_latency.observe(latency_s)
        self.metrics.generation_tokens.inc()

    def on_decode_step(self) -> None:
        super().on_decode_step()
        self.metrics.decode_steps.inc()

    def on_preempted(
        self, span: trace.Span, victim: Request, swapped_bytes: int | None, decision: Decision
    ) -> None:
        super().on_preempted(span, victim, swapped_bytes, decision)
        mode = RECOMPUTE if swapped_bytes is None else SWAP
        self.metrics.preemptions.labels(mode).inc()
        self.metrics.preemptions_by_reason.labels(decision.reason, mode).inc()
        if swapped_bytes is None:
            self.metrics.preemptions_recomputed.labels(recompute_because(decision)).inc()

    def on_preemption_deferred(self, candidates: int) -> None:
        super().on_preemption_deferred(candidates)
        self.metrics.preemptions_deferred.inc()

    def on_finished(self, reason: str) -> None:
        self.metrics.finished_requests.labels(reason or "error").inc()
        self._observe_finished()
