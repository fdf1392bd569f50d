"""OpenTelemetry tracing for both services, configured only by environment variables.

Off by default. Tracing turns on when one of these is set (standard OpenTelemetry names, read as
the SDK reads them):

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), or
  ``OTEL_TRACES_EXPORTER=otlp``: spans go to an OTLP collector (Jaeger, OTel collector) through a
  ``BatchSpanProcessor``. ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (else
  ``OTEL_EXPORTER_OTLP_PROTOCOL``) picks the wire: ``grpc`` (the default, port 4317) or
  ``http/protobuf`` (port 4318; the exporter appends ``/v1/traces`` to the generic endpoint).
  Endpoint, headers and TLS come from the ``OTEL_EXPORTER_OTLP_*`` variables; batching from
  ``OTEL_BSP_*``.
- ``OTEL_TRACES_EXPORTER=console``: spans printed to stdout, one JSON object a line.
- ``KVTIER_TRACE_FILE=path`` (kvtier's own, for tests and debugging): spans appended to ``path``,
  one JSON object a line, through a ``SimpleSpanProcessor`` (written when the span ends).

``OTEL_SERVICE_NAME`` overrides the service's default name (``service.version`` is kvtier's
version), ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` pick the sampler (default
``parentbased_always_on``), ``OTEL_SDK_DISABLED=true`` keeps everything off, and
``OTEL_PYTHON_GRPC_EXCLUDED_SERVICES`` (comma-separated, e.g. ``grpc.health.v1.Health``) keeps
those services' RPCs out of traces. Lease heartbeats (``CacheService/Heartbeat``, one root trace
a beat) are left out unless ``KVTIER_TRACE_HEARTBEATS=1``.

NOTE: with tracing off no SDK ``TracerProvider`` is installed and neither the SDK nor the gRPC
instrumentation is imported: ``tracer()`` returns the API's no-op tracer, the interceptor lists
are empty and channels are plain, so a disabled deployment pays nothing per RPC.

Context crosses process boundaries in W3C ``traceparent`` metadata (the API's default global
propagator), so client -> compute -> cache is one trace when every hop uses the interceptors and
channels below. Spans still queued are exported by ``shutdown_tracing()``, which both services
call on their way out (and atexit runs). Wiring into a grpc.aio service::

    telemetry.setup_tracing("kvtier-cache")          # before the server and channels are built
    server = grpc.aio.server(interceptors=telemetry.aio_server_interceptors())
    channel = telemetry.aio_channel("localhost:50051")
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import grpc
from opentelemetry import trace

TRACE_FILE_ENV = "KVTIER_TRACE_FILE"
TRACE_HEARTBEATS_ENV = "KVTIER_TRACE_HEARTBEATS"
PROTOCOLS = ("grpc", "http/protobuf")


class _TracingState:
    """What ``setup_tracing`` decided, once per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.decided = False
        self.provider: Any = None  # opentelemetry.sdk.trace.TracerProvider when tracing is on
        self.shut_down = False


_STATE = _TracingState()


def _exporter_names() -> set[str]:
    """The exporters the environment asks for: subset of {"otlp", "console"}."""
    names = {n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()}
    if "none" in names:
        return set()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    # An endpoint alone means "send there", as the opentelemetry-instrument launcher reads it.
    if endpoint and not names:
        names.add("otlp")
    return names & {"otlp", "console"}


def otlp_protocol() -> str:
    """The OTLP wire the environment asks for: the per-signal variable, then the generic one, else grpc.

    Raises:
        ValueError: a protocol this exporter does not speak (``http/json``, a typo).
    """
    value = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    protocol = value.strip().lower()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol {value!r}: kvtier exports traces over {' or '.join(PROTOCOLS)}")
    return protocol


def _otlp_exporter() -> Any:
    """The OTLP span exporter for ``otlp_protocol()`` (it reads its endpoint, headers and TLS itself)."""
    if otlp_protocol() == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def _json_line(span: Any) -> str:
    return span.to_json(indent=None) + "\n"


def setup_tracing(default_service_name: str) -> bool:
    """Install an SDK tracer provider if the environment asks for tracing; idempotent.

    Args:
        default_service_name: ``service.name`` resource attribute unless ``OTEL_SERVICE_NAME`` is set.

    Returns:
        True if a provider is installed (now or by an earlier call), False if tracing is off.

    Raises:
        ValueError: an OTLP protocol other than ``grpc`` or ``http/protobuf`` is asked for.
    """
    with _STATE.lock:
        if _STATE.decided:
            return _STATE.provider is not None
        _STATE.decided = True
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return False
        exporters = _exporter_names()
        trace_file = os.environ.get(TRACE_FILE_ENV)
        if not exporters and not trace_file:
            return False

        # Imported here so that a process with tracing off never loads the SDK.
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )

        from kvtier import __version__

        exporter = _otlp_exporter() if "otlp" in exporters else None  # a bad protocol fails here, first
        service_name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
        # The sampler comes from OTEL_TRACES_SAMPLER / _ARG when none is passed.
        resource = Resource.create({SERVICE_NAME: service_name, SERVICE_VERSION: __version__})
        provider = TracerProvider(resource=resource)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        if "console" in exporters:
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(formatter=_json_line)))
        if trace_file:
            # Line-buffered append: several processes may share one file, each span one write.
            out = open(trace_file, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives until exit)
            provider.add_span_processor(
                SimpleSpanProcessor(ConsoleSpanExporter(out=out, formatter=_json_line))
            )
        trace.set_tracer_provider(provider)
        _STATE.provider = provider
        atexit.register(shutdown_tracing)
        return True


def tracing_enabled() -> bool:
    """True once ``setup_tracing`` has installed a provider in this process."""
    return _STATE.provider is not None


def tracer(name: str) -> trace.Tracer:
    """The tracer for module ``name`` (a no-op tracer while tracing is off)."""
    return trace.get_tracer(name)


def _grpc_filter() -> Any:
    """Filter that leaves out the services named in OTEL_PYTHON_GRPC_EXCLUDED_SERVICES and, unless
    KVTIER_TRACE_HEARTBEATS is set, the lease heartbeats (None: trace all)."""
    from opentelemetry.instrumentation.grpc import filters

    names = [
        s.strip() for s in os.environ.get("OTEL_PYTHON_GRPC_EXCLUDED_SERVICES", "").split(",") if s.strip()
    ]
    excluded = [filters.service_name(n) for n in names]
    if os.environ.get(TRACE_HEARTBEATS_ENV, "").strip().lower() not in ("1", "true", "yes"):
        excluded.append(
            filters.all_of(filters.service_name("kvtier.v1.CacheService"), filters.method_name("Heartbeat"))
        )
    if not excluded:
        return None
    return filters.negate(filters.any_of(*excluded))


def aio_server_interceptors() -> list:
    """Interceptors for ``grpc.aio.server(interceptors=...)``: [] while tracing is off.

    NOTE: the OTel aio interceptor iterates server-streaming handlers with ``async for``, so a
    streaming RPC (e.g. ``Generate``) must be written as an async generator (``yield``), not with
    ``context.write``.
    """
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_grpc_filter())]


def server_interceptors() -> list:
    """Interceptors for a sync ``grpc.server(executor, interceptors=...)``: [] while tracing is off."""
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor(filter_=_grpc_filter())]


def aio_channel(
    target: str,
    options: list[tuple[str, Any]] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.aio.Channel:
    """grpc.aio channel to ``target`` (``host:port`` or ``unix:///path``) that carries trace context;
    TLS with ``credentials``, insecure without."""
    interceptors = None
    if tracing_enabled():
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        interceptors = aio_client_interceptors(filter_=_grpc_filter())
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def sync_channel(
    target: str,
    options: list[tuple[str, Any]] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.Channel:
    """Sync channel to ``target`` that carries trace context; TLS with ``credentials``.

    NOTE: wrapped with the instrumentation package's own ``intercept_channel``: its
    ``client_interceptor()`` implements the package's interceptor interfaces, not grpc's, so
    ``grpc.intercept_channel`` cannot take it.
    """
    if credentials is not None:
        channel = grpc.secure_channel(target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if not tracing_enabled():
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor, intercept_channel

    return intercept_channel(channel, client_interceptor(filter_=_grpc_filter()))


def shutdown_tracing(timeout_s: float = 10.0) -> None:
    """Export every span still queued, then stop the exporters (the services call it on their way
    out; also registered atexit; safe to call more than once: only the first call acts).

    NOTE: spans that end during shutdown (the last step's, its Free call's) are still in the batch
    processor's queue when the server stops; without this they would be lost with the process.
    """
    with _STATE.lock:
        provider = _STATE.provider
        if provider is None or _STATE.shut_down:
            return
        _STATE.shut_down = True
    provider.force_flush(int(timeout_s * 1000))
    provider.shutdown()
