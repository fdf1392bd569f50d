"""The gateway's own Prometheus metrics, on their own registry (served at GET /metrics)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from kvtier.metrics import COMPUTE_RPC_BUCKETS

# Seconds: first tokens come in milliseconds (prefix hits) to tens of seconds (long prefills).
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
)


class GatewayMetrics:
    """Requests by endpoint and status, latency, time to first token, tokens."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        ProcessCollector(registry=r)  # process_* series, as every kvtier service has
        p = "kvtier_gateway"
        self.requests = Counter(
            f"{p}_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            f"{p}_request_duration_seconds",
            "Arrival to the last byte of the response (a stream's end).",
            ["endpoint"],
            buckets=COMPUTE_RPC_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Arrival to the first generated token, as the gateway saw it.",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens", "Prompt tokens of finished completions.", registry=r
        )
        self.cached_prompt_tokens = Counter(
            f"{p}_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Completion tokens generated.", registry=r)
        self._add_router_series(r)

    def _add_router_series(self, r: CollectorRegistry) -> None:
        """The router's (gateway/router.py), when the gateway routes across nodes; node_*: per node."""
        self.route_decisions = Counter(
            "kvtier_router_decisions",
            "Routing decisions by reason: prefix (the node holding the longest prefix), load_spill "
            "(a node holding more of the prompt was too loaded), tie (no node holds any of it), "
            "round_robin, random, only_node; node_down counts a node routed around (per request), "
            "resync an event stream restarted.",
            ["reason"],
            registry=r,
        )
        for reason in (
            "prefix",
            "load_spill",
            "tie",
            "round_robin",
            "random",
            "only_node",
            "node_down",
            "resync",
        ):
            self.route_decisions.labels(reason=reason)
        self.node_requests = Counter(
            "kvtier_gateway_node_requests", "Requests sent to each node.", ["node"], registry=r
        )
        self.node_inflight = Gauge(
            "kvtier_gateway_node_requests_in_flight", "Requests open on each node.", ["node"], registry=r
        )
        self.node_up = Gauge(
            "kvtier_gateway_node_up",
            "1 while the router routes to the node, 0 while it routes around it.",
            ["node"],
            registry=r,
        )
        self.node_predicted_tokens = Counter(
            "kvtier_gateway_node_predicted_cached_tokens",
            "Cached prompt tokens the router predicted on each node, for finished requests.",
            ["node"],
            registry=r,
        )
        self.node_actual_tokens = Counter(
            "kvtier_gateway_node_actual_cached_tokens",
            "Cached prompt tokens finished requests actually got on each node (usage.cached_tokens).",
            ["node"],
            registry=r,
        )
        self.route_predicted_tokens = Counter(
            "kvtier_router_predicted_cached_tokens",
            "Cached prompt tokens the router predicted on the node it chose, for finished requests.",
            registry=r,
        )
        self.route_actual_tokens = Counter(
            "kvtier_router_actual_cached_tokens",
            "Cached prompt tokens those requests actually got (usage.cached_tokens): with "
            "kvtier_router_predicted_cached_tokens, the router's accuracy.",
            registry=r,
        )
        self.route_error_tokens = Histogram(
            "kvtier_router_prediction_error_tokens",
            "|predicted - actual| cached prompt tokens per finished request.",
            buckets=(0, 16, 64, 256, 1024, 4096),
            registry=r,
        )

    def watch_node(self, node: str, up: Callable[[], bool], inflight: Callable[[], int]) -> None:
        """Per-node series of a node the router follows: up/down and in-flight read when scraped."""
        self.node_up.labels(node=node).set_function(lambda: 1.0 if up() else 0.0)
        self.node_inflight.labels(node=node).set_function(inflight)
        for series in (self.node_requests, self.node_predicted_tokens, self.node_actual_tokens):
            series.labels(node=node)

    def forget_node(self, node: str) -> None:
        """A node gone (DNS): its series end."""
        for series in (
            self.node_up,
            self.node_inflight,
            self.node_requests,
            self.node_predicted_tokens,
            self.node_actual_tokens,
        ):
            with contextlib.suppress(KeyError):
                series.remove(node)

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.request_duration.labels(endpoint).observe(seconds)

    def tokens(self, prompt: int, cached: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.cached_prompt_tokens.inc(cached)
        self.generation_tokens.inc(completion)
