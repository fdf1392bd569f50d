"""Prometheus plumbing both services share: RPC latency per method and status, the scrape server.

Each service's own metrics live with it (``cachesvc.metrics.CacheMetrics``,
``computesvc.metrics.ComputeMetrics``), each on its own ``CollectorRegistry`` (not the global
one), so two services, or many tests, in one process never clash. A service exposes its registry
with ``start_metrics_server(port, metrics.registry)`` and times every RPC through
``kvtier.grpc_server.CallGuard(server, token, metrics)``, which labels calls with ``rpc_status_name``.

Names follow Prometheus conventions: ``kvtier_`` prefix, the unit in the name (``_seconds``,
``_bytes``, ``_blocks``, ``_tokens``), ``_total`` on counters (added by prometheus-client).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, start_http_server

# Bucket bounds in seconds.
# fmt: off
# Control-plane RPCs take ~0.5 ms over loopback; the buckets span 0.1 ms .. 1 s around that.
CACHE_RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Generate streams a whole completion, so the compute side also needs minutes.
COMPUTE_RPC_BUCKETS = CACHE_RPC_BUCKETS + (2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# fmt: on


class RpcLatency:
    """A service's metrics group: its registry and the server-side RPC latency histogram.

    Subclasses add their own series to ``self.registry`` after calling ``__init__``.
    """

    def __init__(
        self, registry: CollectorRegistry | None, prefix: str, help_text: str, buckets: tuple[float, ...]
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rpc_duration = Histogram(
            f"{prefix}_rpc_duration_seconds",
            help_text,
            ["method", "code"],
            buckets=buckets,
            registry=self.registry,
        )
        self._rpc_children: dict[tuple[str, str], Any] = {}

    def observe_rpc(self, method: str, seconds: float, code: str) -> None:
        """Record one RPC: short method name (``Allocate``), duration in seconds, status name (``OK``)."""
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
