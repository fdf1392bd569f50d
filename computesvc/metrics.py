"""Prometheus metrics of one compute replica: scheduler, latency and tokens.

Per-request series (queue, prefill, decode, end-to-end time; prompt and generation tokens per
request) follow vLLM's definitions: queue = arrival -> first Allocate, prefill = first Allocate ->
first token, decode = first token -> last token, inference = first Allocate -> last token,
end to end = arrival -> finish. `vllm_aliases` names the series vLLM exports the same figures as.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.computesvc.preemption import REASONS, RECOMPUTE, RECOMPUTE_BECAUSE, SWAP
from kvtier.metrics import COMPUTE_RPC_BUCKETS, RpcLatency, VllmAliases

# Bucket bounds in seconds.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                       1.0, 2.5)
# A whole request's phases: milliseconds (the tiny model, a prefix hit) to an hour (vLLM's top is 7680 s).
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                   15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens per request: 1, 2, 5, 10, 20, 50, ... as vLLM's build_1_2_5_buckets.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
# fmt: on

# BlockCache methods the scheduler calls (computesvc/cache_port.py), labelled from the start.
CACHE_METHODS = ("allocate", "extend", "commit", "free", "swap_out", "swap_in")
FINISH_REASONS = ("stop", "length", "error")


class ComputeMetrics(RpcLatency):
    """Scheduler, latency and token metrics of one compute replica (computesvc.observer.MetricsObserver updates them)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(
            registry,
            "kvtier_compute",
            "Server-side time of one RPC (a Generate stream end to end).",
            COMPUTE_RPC_BUCKETS,
        )
        r, p = self.registry, "kvtier_compute"
        self.running_sequences = Gauge(f"{p}_running_sequences", "Sequences in the decode batch.", registry=r)
        self.waiting_sequences = Gauge(
            f"{p}_waiting_sequences", "Sequences queued or preempted, not running.", registry=r
        )
        self.preemptions = Counter(
            f"{p}_preemptions", "Sequences preempted for lack of blocks.", ["kind"], registry=r
        )
        self.preemptions_by_reason = Counter(
            f"{p}_preemptions_by_reason",
            "Sequences preempted, by why (pool: no room; tenant: its own tenant's limit; forced: every "
            "candidate guarded against thrash and none could run) and mode (swap, recompute).",
            ["reason", "mode"],
            registry=r,
        )
        self.preemptions_recomputed = Counter(
            f"{p}_preemptions_recomputed",
            "Sequences preempted by freeing them to recompute, by why not a swap (cheaper: the cost "
            "model's choice; tenant, forced, host_full: a swap was not allowed; host_refused: the host "
            "tier refused the swap chosen; policy: newest-recompute never swaps).",
            ["because"],
            registry=r,
        )
        self.preemptions_deferred = Counter(
            f"{p}_preemptions_deferred",
            "Times no sequence was preempted because every candidate was guarded against thrash "
            "(swapped in too recently, or preempted too often) and others could still run.",
            registry=r,
        )
        self._latency_metrics()
        self._token_metrics()
        # Label values known up front, so dashboards see zeros instead of missing series.
        for kind in (SWAP, RECOMPUTE):
            self.preemptions.labels(kind)
            for reason in REASONS:
                self.preemptions_by_reason.labels(reason, kind)
        for because in RECOMPUTE_BECAUSE:
            self.preemptions_recomputed.labels(because)
        for method in CACHE_METHODS:
            self.cache_calls.labels(method)
        for reason in FINISH_REASONS:
            self.finished_requests.labels(reason)
        self.rpc_duration.labels("Generate", "OK")

    def _latency_metrics(self) -> None:
        """Per-token and per-request latency histograms."""
        r, p = self.registry, "kvtier_compute"
        self.time_to_first_token = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Request arrival to first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            f"{p}_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one sequence.",
            buckets=INTER_TOKEN_BUCKETS,
            registry=r,
        )

        def request_histogram(name: str, what: str, buckets=REQUEST_BUCKETS) -> Histogram:
            return Histogram(f"{p}_{name}", f"{what}, per finished request.", buckets=buckets, registry=r)

        self.e2e_request_latency = request_histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.request_queue_time = request_histogram(
            "request_queue_time_seconds", "Arrival to the first Allocate (waiting for a place)"
        )
        self.request_prefill_time = request_histogram(
            "request_prefill_time_seconds", "First Allocate to the first token"
        )
        self.request_decode_time = request_histogram(
            "request_decode_time_seconds", "First token to the last token"
        )
        self.request_inference_time = request_histogram(
            "request_inference_time_seconds", "First Allocate to the last token"
        )
        self.request_prompt_tokens = request_histogram(
            "request_prompt_tokens", "Prompt tokens", TOKEN_BUCKETS
        )
        self.request_generation_tokens = request_histogram(
            "request_generation_tokens", "Tokens generated", TOKEN_BUCKETS
        )

    def _token_metrics(self) -> None:
        """Token, request, cache-call and step counters."""
        r, p = self.registry, "kvtier_compute"
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens",
            "Prompt tokens of admitted requests (= prefix-cache query tokens).",
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            f"{p}_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache (prefill skipped; = prefix-cache hit tokens).",
            registry=r,
        )
        self.finished_requests = Counter(
            f"{p}_finished_requests", "Requests finished, by finish reason.", ["finish_reason"], registry=r
        )
        self.cache_calls = Counter(
            f"{p}_cache_calls", "RPCs made to the cache service.", ["method"], registry=r
        )
        self.decode_steps = Counter(f"{p}_decode_steps", "Batched decode steps run.", registry=r)

    def vllm_aliases(self, model_name: str) -> VllmAliases:
        """The replica's series under vLLM's names (register it on ``self.registry``): requests,
        latencies, tokens, preemptions, and the prefix-cache queries and hits of its own admissions.
        KV cache usage and the cache config come from the cache service (cachesvc/metrics.py)."""
        return VllmAliases(
            model_name,
            [
                (self.running_sequences, ("vllm:num_requests_running",)),
                (self.waiting_sequences, ("vllm:num_requests_waiting",)),
                (self.preemptions, ("vllm:num_preemptions",)),
                (self.prompt_tokens, ("vllm:prompt_tokens", "vllm:prefix_cache_queries")),
                (self.cached_prompt_tokens, ("vllm:prefix_cache_hits",)),
                (self.generation_tokens, ("vllm:generation_tokens",)),
                (self.finished_requests, ("vllm:request_success",), {"finish_reason": "finished_reason"}),
                (self.time_to_first_token, ("vllm:time_to_first_token_seconds",)),
                # vLLM renamed time_per_output_token to inter_token_latency; dashboards read either.
                (
                    self.inter_token_latency,
                    ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
                ),
                (self.e2e_request_latency, ("vllm:e2e_request_latency_seconds",)),
                (self.request_queue_time, ("vllm:request_queue_time_seconds",)),
                (self.request_prefill_time, ("vllm:request_prefill_time_seconds",)),
                (self.request_decode_time, ("vllm:request_decode_time_seconds",)),
                (self.request_inference_time, ("vllm:request_inference_time_seconds",)),
                (self.request_prompt_tokens, ("vllm:request_prompt_tokens",)),
                (self.request_generation_tokens, ("vllm:request_generation_tokens",)),
            ],
        )
