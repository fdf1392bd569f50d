"""Prometheus metrics of the cache service and the compute service.

Each group lives on its own ``CollectorRegistry`` (not the global one), so two services, or
many tests, in one process never clash. A service exposes its registry with
``start_metrics_server(port, metrics.registry)`` and times every RPC through
``kvtier.grpc_server.CallGuard(server, token, metrics)``, which labels calls with ``rpc_status_name``.

Names follow Prometheus conventions: ``kvtier_`` prefix, the unit in the name (``_seconds``,
``_bytes``, ``_blocks``, ``_tokens``), ``_total`` on counters (added by prometheus-client).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Bucket bounds in seconds.
# fmt: off
# Control-plane RPCs take ~0.5 ms (DESIGN §8); the buckets span 0.1 ms .. 1 s around that.
CACHE_RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Generate streams a whole completion, so the compute side also needs minutes.
COMPUTE_RPC_BUCKETS = CACHE_RPC_BUCKETS + (2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                       1.0, 2.5)
# fmt: on


class CacheMetrics:
    """Block pool, prefix cache, swap and lease metrics of one cache service.

    Gauges and counters are filled from the cumulative numbers of ``GetStats`` by
    ``update_from_stats`` (call it after a batch of RPCs or on a timer, from the event loop);
    RPC latency by ``observe_rpc`` (called by ``kvtier.grpc_server.CallGuard``).
    """

    # (stats keys, GetStatsResponse name first) -> counter attribute, label values.
    # Values in stats are cumulative since the service started.
    _COUNTER_KEYS = (
        (("prefix_query_tokens",), "prefix_query_tokens", ()),
        (("prefix_hit_tokens",), "prefix_hit_tokens", ()),
        (("num_evictions",), "evictions", ()),
        (("num_swap_out_blocks",), "swapped_blocks", ("out",)),
        (("num_swap_in_blocks",), "swapped_blocks", ("in",)),
        (("num_swap_out_bytes", "swap_out_bytes"), "swapped_bytes", ("out",)),
        (("num_swap_in_bytes", "swap_in_bytes"), "swapped_bytes", ("in",)),
        (("num_expired_leases",), "expired_leases", ()),
    )
    _GAUGE_KEYS = (
        ("num_blocks_total", "capacity_blocks"),
        ("num_blocks_free", "free_blocks"),
        ("num_blocks_used", "used_blocks"),
        ("num_blocks_cached", "cached_blocks"),
        ("usage_percent", "block_usage_percent"),
        ("num_host_blocks_total", "host_capacity_blocks"),
        ("num_host_blocks_used", "host_used_blocks"),
        ("num_sequences", "sequences"),
        ("num_swapped_sequences", "swapped_sequences"),
        ("num_leases", "active_leases"),
        ("num_tokens", "resident_tokens"),
    )

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, "kvtier_cache"
        self.block_usage_percent = Gauge(
            f"{p}_block_usage_percent", "Used blocks / total blocks, 0..100.", registry=r
        )
        self.capacity_blocks = Gauge(f"{p}_capacity_blocks", "Blocks in the device pool.", registry=r)
        self.free_blocks = Gauge(
            f"{p}_free_blocks", "Blocks no sequence references (cached or empty).", registry=r
        )
        self.used_blocks = Gauge(
            f"{p}_used_blocks", "Blocks referenced by at least one sequence.", registry=r
        )
        self.cached_blocks = Gauge(
            f"{p}_cached_blocks", "Blocks holding a hash in the prefix index.", registry=r
        )
        self.host_capacity_blocks = Gauge(
            f"{p}_host_capacity_blocks", "Blocks in the host swap tier.", registry=r
        )
        self.host_used_blocks = Gauge(
            f"{p}_host_used_blocks", "Host-tier blocks holding swapped KV.", registry=r
        )
        self.sequences = Gauge(f"{p}_sequences", "Sequences the cache service holds.", registry=r)
        self.swapped_sequences = Gauge(
            f"{p}_swapped_sequences", "Sequences living in the host tier.", registry=r
        )
        self.prefix_query_tokens = Counter(f"{p}_prefix_query_tokens", "Prompt tokens looked up.", registry=r)
        self.prefix_hit_tokens = Counter(f"{p}_prefix_hit_tokens", "Prompt tokens found cached.", registry=r)
        self.prefix_hit_ratio = Gauge(
            f"{p}_prefix_hit_ratio", "Hit tokens / query tokens since start, 0..1.", registry=r
        )
        self.evictions = Counter(f"{p}_evictions", "Cached blocks evicted from the prefix index.", registry=r)
        self.swapped_blocks = Counter(
            f"{p}_swapped_blocks",
            "Blocks moved to (out) or from (in) the host tier.",
            ["direction"],
            registry=r,
        )
        self.swapped_bytes = Counter(
            f"{p}_swapped_bytes",
            "Bytes moved to (out) or from (in) the host tier.",
            ["direction"],
            registry=r,
        )
        self.active_leases = Gauge(f"{p}_active_leases", "Compute leases alive.", registry=r)
        self.resident_tokens = Gauge(
            f"{p}_resident_tokens", "Tokens of the sequences held on the device.", registry=r
        )
        self.slot_waste_ratio = Gauge(
            f"{p}_slot_waste_ratio",
            "Token slots of live block tables holding no token yet (partly filled last blocks, "
            "lookahead), 0..1.",
            registry=r,
        )
        self.expired_leases = Counter(
            f"{p}_expired_leases", "Leases that missed their heartbeats.", registry=r
        )
        self.rpc_duration = Histogram(
            f"{p}_rpc_duration_seconds",
            "Server-side time of one RPC.",
            ["method", "code"],
            buckets=CACHE_RPC_BUCKETS,
            registry=r,
        )
        self._rpc_children: dict[tuple[str, str], Any] = {}
        # (counter attribute, label values) -> last cumulative value seen in stats
        self._last_cumulative: dict[tuple[str, tuple[str, ...]], float] = {}

    def observe_rpc(self, method: str, seconds: float, code: str) -> None:
        """Record one RPC: short method name (``Allocate``), duration in seconds, status name (``OK``)."""
        # NOTE: labels() locks and builds a key each call (~2.5 us); a child is kept per (method, code).
        child = self._rpc_children.get((method, code))
        if child is None:
            child = self._rpc_children[method, code] = self.rpc_duration.labels(method, code)
        child.observe(seconds)

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        """Set gauges and advance counters from a ``GetStatsResponse``-shaped dict; missing keys are skipped.

        Counters advance by the difference to the previous cumulative value; a value lower than
        the last one (the source restarted) counts from zero again.
        """
        for key, attr in self._GAUGE_KEYS:
            if key in stats:
                getattr(self, attr).set(stats[key])
        for keys, attr, labels in self._COUNTER_KEYS:
            key = next((k for k in keys if k in stats), None)
            if key is None:
                continue
            value = float(stats[key])
            last = self._last_cumulative.get((attr, labels), 0.0)
            delta = value - last if value >= last else value
            self._last_cumulative[attr, labels] = value
            counter = getattr(self, attr)
            if delta:
                (counter.labels(*labels) if labels else counter).inc(delta)
        if stats.get("num_token_slots"):
            self.slot_waste_ratio.set(1.0 - stats.get("num_tokens", 0) / stats["num_token_slots"])
        queries = self._last_cumulative.get(("prefix_query_tokens", ()), 0.0)
        if queries:
            self.prefix_hit_ratio.set(self._last_cumulative.get(("prefix_hit_tokens", ()), 0.0) / queries)


class ComputeMetrics:
    """Scheduler, latency and token metrics of one compute replica; the scheduler updates them directly."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
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
        self.rpc_duration = Histogram(
            f"{p}_rpc_duration_seconds",
            "Server-side time of one RPC (a Generate stream end to end).",
            ["method", "code"],
            buckets=COMPUTE_RPC_BUCKETS,
            registry=r,
        )
        self._rpc_children: dict[tuple[str, str], Any] = {}
        # Label values known up front, so dashboards see zeros instead of missing series.
        for kind in ("swap", "recompute"):
            self.preemptions.labels(kind)

    def observe_rpc(self, method: str, seconds: float, code: str) -> None:
        """Record one RPC: short method name (``Generate``), duration in seconds, status name (``OK``)."""
        # NOTE: labels() locks and builds a key each call (~2.5 us); a child is kept per (method, code).
        child = self._rpc_children.get((method, code))
        if child is None:
            child = self._rpc_children[method, code] = self.rpc_duration.labels(method, code)
        child.observe(seconds)


class RpcObserver(Protocol):
    def observe_rpc(self, method: str, seconds: float, code: str) -> None: ...


def rpc_status_name(context, error: BaseException | None) -> str:
    """The ``code`` label of a finished RPC: the status the handler set or aborted with (``OK``,
    ``NOT_FOUND``), else ``OK``, ``CANCELLED`` when the client went away, ``UNKNOWN`` for an
    uncaught exception. `context` is the call's servicer context, `error` what the handler raised.
    """
    code = context.code()  # set by set_code() or abort(); None when the handler set none
    if code is not None:
        return code.name
    if error is None:
        return "OK"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    return "UNKNOWN"


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> int:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread; port 0 picks a free one.

    Returns:
        The bound TCP port.
    """
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server.server_port
