"""Prometheus metrics of one compute replica: scheduler, latency and tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.metrics import COMPUTE_RPC_BUCKETS, RpcLatency

# Bucket bounds in seconds.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                       1.0, 2.5)
# fmt: on


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
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens received.", registry=r)
        self.cached_prompt_tokens = Counter(
            f"{p}_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache (prefill skipped).",
            registry=r,
        )
        self.finished_requests = Counter(
            f"{p}_finished_requests", "Requests finished, by finish reason.", ["finish_reason"], registry=r
        )
        self.cache_calls = Counter(
            f"{p}_cache_calls", "RPCs made to the cache service.", ["method"], registry=r
        )
        self.decode_steps = Counter(f"{p}_decode_steps", "Batched decode steps run.", registry=r)
        # Label values known up front, so dashboards see zeros instead of missing series.
        for kind in ("swap", "recompute"):
            self.preemptions.labels(kind)
