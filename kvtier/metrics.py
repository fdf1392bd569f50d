"""Prometheus plumbing both services share: RPC latency per method and status, the scrape server.

Each service's own metrics live with it (``cachesvc.metrics.CacheMetrics``,
``computesvc.metrics.ComputeMetrics``), each on its own ``CollectorRegistry`` (not the global
one), so two services, or many tests, in one process never clash. A service exposes its registry
with ``start_metrics_server(port, metrics.registry)`` and times every RPC through
``kvtier.call_guard.CallGuard(server, token, metrics)``, which labels calls with ``rpc_status_name``.

Names follow Prometheus conventions: ``kvtier_`` prefix, the unit in the name (``_seconds``,
``_bytes``, ``_blocks``, ``_tokens``), ``_total`` on counters (added by prometheus-client).
Every registry also carries the ``process_*`` series (``ProcessCollector``); no counter or
histogram exports a ``_created`` series. With
``--vllm-metrics`` a service adds a ``VllmAliases`` collector: the series a vLLM dashboard reads,
again under vLLM's ``vllm:`` names with a ``model_name`` label, collected from the same metric
objects at scrape time (one source, nothing updated twice).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# NOTE: no ``_created`` sample per counter and histogram child (``kvtier_cache_evictions_created``
# beside ``kvtier_cache_evictions_total``): dashboards never read them and they double the series
# count. vLLM turns them off the same way. prometheus-client's setting is process-wide, and every
# process that serves metrics (cache, compute, gateway) imports this module first.
disable_created_metrics()

# Bucket bounds in seconds.
# fmt: off
# Control-plane RPCs take ~0.5 ms over loopback; the buckets span 0.1 ms .. 1 s around that.
CACHE_RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Generate streams a whole completion, so the compute side also needs minutes.
COMPUTE_RPC_BUCKETS = CACHE_RPC_BUCKETS + (2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# fmt: on

# The model_name of the built-in tiny model: the gateway's default --served-model-name for it
# (gateway/config.py TINY_MODEL_NAME), so the services' series and the gateway's join on it.
TINY_MODEL_NAME = "kvtier-tiny"


class RpcLatency:
    """A service's metrics group: its registry and the server-side RPC latency histogram.

    Subclasses add their own series to ``self.registry`` after calling ``__init__``.
    """

    def __init__(
        self, registry: CollectorRegistry | None, prefix: str, help_text: str, buckets: tuple[float, ...]
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        ProcessCollector(
            registry=self.registry
        )  # process_cpu_seconds_total, process_resident_memory_bytes, ...
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


def served_model_name(model_dir: str | None) -> str:
    """The ``model_name`` label of a service started with ``--model model_dir`` (None: the built-in
    tiny model): the directory's name, as the gateway names the model by default."""
    return Path(model_dir).resolve().name if model_dir else TINY_MODEL_NAME


def metrics_host(listen: str) -> str:
    """The address the metrics server binds by default: the host the service's gRPC ``listen``
    address names (``tcp://0.0.0.0:50051`` -> ``0.0.0.0``, ``tcp://[::1]:1`` -> ``::1``,
    ``tcp://node7:1`` -> ``node7``), and loopback for a Unix socket (``unix:///path``) or
    ``localhost``. Never wider than the service itself."""
    if listen.startswith("unix:"):
        return "127.0.0.1"
    hostport = listen.split("://", 1)[-1]
    host = (hostport.rsplit(":", 1)[0] if ":" in hostport else hostport).strip("[]")
    return "127.0.0.1" if host in ("", "localhost") else host


def _renamed(family: Metric, name: str, labels: dict[str, str], renames: dict[str, str]) -> Metric:
    """`family` under `name`, each sample renamed alike (``_total``, ``_bucket`` kept), its label
    names mapped through `renames` and `labels` added."""
    out = Metric(name, family.documentation, family.type, family.unit)
    cut = len(family.name)
    out.samples = [
        s._replace(
            name=name + s.name[cut:],
            labels={**{renames.get(k, k): v for k, v in s.labels.items()}, **labels},
        )
        for s in family.samples
    ]
    return out


class VllmAliases(Collector):
    """Collects metric objects again under vLLM's names, each sample with a ``model_name`` label.

    `aliases`: (a prometheus-client metric object, its vLLM family names: a counter's without
    ``_total``, an info's without ``_info``[, {our label name: vLLM's}]). Registered on the same
    registry as the objects.
    """

    def __init__(self, model_name: str, aliases: Iterable[tuple]) -> None:
        self.labels = {"model_name": model_name}
        self.aliases = [(a[0], a[1], a[2] if len(a) > 2 else {}) for a in aliases]

    def collect(self) -> Iterator[Metric]:
        for metric, names, renames in self.aliases:
            for family in metric.collect():
                for name in names:
                    yield _renamed(family, name, self.labels, renames)

    def describe(self) -> list[Metric]:
        return []  # no name checks against the kvtier_ series (the names differ by construction)


def serve_metrics(metrics: Any, cfg: Any, log: logging.Logger) -> int:
    """Serve a service's `metrics` (CacheMetrics / ComputeMetrics) as its config says: on
    ``cfg.metrics_port``, bound to ``cfg.metrics_host`` or else the host of ``cfg.listen``
    (`metrics_host`), with the ``vllm:`` aliases when ``cfg.vllm_metrics`` (``model_name``:
    ``cfg.metrics_model_name`` or `served_model_name`); logs the URL.

    Returns:
        The bound TCP port.
    """
    if cfg.vllm_metrics:
        model_name = cfg.metrics_model_name or served_model_name(cfg.model)
        metrics.registry.register(metrics.vllm_aliases(model_name))
    host = cfg.metrics_host or metrics_host(cfg.listen)
    port = start_metrics_server(cfg.metrics_port, metrics.registry, host)
    url_host = f"[{host}]" if ":" in host else host
    names = " (also under vllm: names)" if cfg.vllm_metrics else ""
    log.info("Prometheus metrics on http://%s:%d/metrics%s", url_host, port, names)
    return port


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "127.0.0.1") -> int:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread; port 0 picks a free one.

    Returns:
        The bound TCP port.
    """
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server.server_port
