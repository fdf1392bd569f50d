"""What the scheduler reports: counts, spans, logs and (when enabled) Prometheus metrics.

The scheduler calls one `SchedulerObserver` at each of its events and never checks whether
metrics are on: the base class counts into `SchedulerStats` and traces (spans cost nothing when
tracing is off); `MetricsObserver` also updates a replica's `ComputeMetrics`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace

from computesvc.request import Request, Status
from kvtier import telemetry

if TYPE_CHECKING:
    from computesvc.metrics import ComputeMetrics

log = logging.getLogger("kvtier.compute")


@dataclass
class SchedulerStats:
    """Counts since the scheduler started (benchmarks read them; metrics export the same events)."""

    steps: int = 0
    decode_steps: int = 0
    cache_calls: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0


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


class SchedulerObserver:
    """Counts and traces the scheduler's events; exports no metrics."""

    def __init__(self) -> None:
        self.stats = SchedulerStats()
        self._tracer = telemetry.tracer("kvtier.compute.scheduler")

    # ------------------------------------------------------------ spans (context managers)

    def step_span(self, in_flight: list[Request]):
        """Counts a step and opens its span; `in_flight`: running, swapped, then waiting requests."""
        self.stats.steps += 1
        return self._tracer.start_as_current_span("scheduler.step", context=_step_context(in_flight))

    def prefill_span(self, chunks: list[tuple[Request, int]]):
        """The span of one batched prefill forward; `chunks`: (request, tokens prefilled)."""
        return self._tracer.start_as_current_span(
            "prefill",
            links=_links(r for r, _ in chunks),
            attributes={"kvtier.num_seqs": len(chunks), "kvtier.prefill_tokens": sum(n for _, n in chunks)},
        )

    def decode_span(self, reqs: list[Request]):
        """The span of one batched decode forward over `reqs`."""
        return self._tracer.start_as_current_span(
            "decode", links=_links(reqs), attributes={"kvtier.batch_size": len(reqs)}
        )

    def preempt_span(self, victim: Request):
        return self._tracer.start_as_current_span(
            "preempt", attributes={"kvtier.request_id": victim.request_id}
        )

    # ------------------------------------------------------------ events

    def on_step(self, span: trace.Span, running: int, waiting: int, swapped: int) -> None:
        """A step ended with this many sequences in each queue."""
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

    def on_preempted(self, span: trace.Span, victim: Request, swapped_bytes: int | None) -> None:
        """`victim` was swapped out (`swapped_bytes` moved), or freed to recompute (None)."""
        if swapped_bytes is None:
            self.stats.preemptions_recompute += 1
            span.set_attribute("kvtier.preemption", "recompute")
            log.info("preempted request %s: will recompute (host tier full)", victim.request_id)
        else:
            self.stats.preemptions_swap += 1
            span.set_attribute("kvtier.swap_bytes", swapped_bytes)
            span.set_attribute("kvtier.preemption", "swap")
            log.info("preempted request %s: swapped out (%d bytes)", victim.request_id, swapped_bytes)

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

    def on_preempted(self, span: trace.Span, victim: Request, swapped_bytes: int | None) -> None:
        super().on_preempted(span, victim, swapped_bytes)
        self.metrics.preemptions.labels("recompute" if swapped_bytes is None else "swap").inc()

    def on_finished(self, reason: str) -> None:
        self.metrics.finished_requests.labels(reason or "error").inc()
        self._observe_finished()
