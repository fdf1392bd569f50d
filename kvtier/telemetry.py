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
channels below. A batched call made for many requests (one Allocate for a step's new sequences)
has one ``traceparent``, the step's; it also carries each request's own span in
``kvtier-request-traceparents`` (``for_requests``, ``request_metadata``), and the server records
a span per request in that request's trace around its handler (``aio_server_interceptors``):
opening one request's trace shows the cache calls made for it, on both sides. Spans still queued are exported by ``shutdown_tracing()``, which both services
call on their way out (and atexit runs). Wiring into a grpc.aio service::

    telemetry.setup_tracing("kvtier-cache")          # before the server and channels are built
    server = grpc.aio.server(interceptors=telemetry.aio_server_interceptors())
    channel = telemetry.aio_channel("localhost:50051")
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_FILE_ENV = "KVTIER_TRACE_FILE"
TRACE_HEARTBEATS_ENV = "KVTIER_TRACE_HEARTBEATS"
PROTOCOLS = ("grpc", "http/protobuf")
REQUEST_CONTEXTS_KEY = "kvtier-request-traceparents"
"""Call metadata: comma-separated W3C traceparents of the requests a batched call serves."""
MAX_REQUEST_CONTEXTS = 64
"""At most this many per call (about 3.6 KB of metadata, under gRPC's 8 KB default limit); the
requests past it keep their client-side span, linked to the step that made the call."""


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
    """Filter that leaves out the services named in OTEL_PYTHON_GRPC_EXCLUDED_SERVICES, unless
    KVTIER_TRACE_HEARTBEATS is set the lease heartbeats, and always the block event streams
    (WatchEvents, WatchEventBatches: a follower's stream lasts as long as the follower, so its one
    span says nothing; and OTel's sync client wraps the stream in a generator, which ``cancel()``
    cannot end)."""
    from opentelemetry.instrumentation.grpc import filters

    names = [
        s.strip() for s in os.environ.get("OTEL_PYTHON_GRPC_EXCLUDED_SERVICES", "").split(",") if s.strip()
    ]
    excluded = [filters.service_name(n) for n in names]
    cache = filters.service_name("kvtier.v1.CacheService")
    for stream in ("WatchEvents", "WatchEventBatches"):
        excluded.append(filters.all_of(cache, filters.method_name(stream)))
    if os.environ.get(TRACE_HEARTBEATS_ENV, "").strip().lower() not in ("1", "true", "yes"):
        excluded.append(filters.all_of(cache, filters.method_name("Heartbeat")))
    return filters.negate(filters.any_of(*excluded))


def aio_server_interceptors() -> list:
    """Interceptors for ``grpc.aio.server(interceptors=...)``: [] while tracing is off.

    The OTel interceptor's server span is the call's; inside it, ``_RequestSpans`` records a span
    per request the call serves, in that request's trace (``request_metadata``).

    NOTE: the OTel aio interceptor iterates server-streaming handlers with ``async for``, so a
    streaming RPC (e.g. ``Generate``) must be written as an async generator (``yield``), not with
    ``context.write``.
    """
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    # The first interceptor is the outermost: its server span is current in the second's wrapper.
    return [aio_server_interceptor(filter_=_grpc_filter()), _RequestSpans()]


# ---------------------------------------------------------------- a batched call's requests

_requests: contextvars.ContextVar[tuple[trace.SpanContext, ...]] = contextvars.ContextVar(
    "kvtier_requests", default=()
)
_propagator = TraceContextTextMapPropagator()


@contextlib.contextmanager
def for_requests(spans: Iterable[trace.Span]) -> Iterator[None]:
    """While open, calls made through ``request_metadata`` name ``spans`` (one per request the
    call serves: its span around the call) as the requests they serve."""
    contexts = tuple(c for s in spans if (c := s.get_span_context()).is_valid and c.trace_flags.sampled)
    token = _requests.set(contexts[:MAX_REQUEST_CONTEXTS])
    try:
        yield
    finally:
        _requests.reset(token)


def request_metadata(metadata: tuple) -> tuple:
    """``metadata`` plus the ``REQUEST_CONTEXTS_KEY`` entry of the open ``for_requests`` (as is
    outside one, and always while tracing is off)."""
    contexts = _requests.get()
    if not contexts:
        return metadata
    parents = []
    for context in contexts:
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, trace.set_span_in_context(trace.NonRecordingSpan(context)))
        parents.append(carrier["traceparent"])
    return (*metadata, (REQUEST_CONTEXTS_KEY, ",".join(parents)))


class _RequestSpans(grpc.aio.ServerInterceptor):
    """A unary call carrying ``REQUEST_CONTEXTS_KEY``: a span named after its method in each
    request's trace, child of that request's client-side span, around the handler; each linked to
    the call's own server span, which links back to every one."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        value = next((v for k, v in metadata if k == REQUEST_CONTEXTS_KEY), None)
        if handler is None or handler.unary_unary is None or not value:
            return handler
        behavior, method = handler.unary_unary, handler_call_details.method
        parents = value.split(",")[:MAX_REQUEST_CONTEXTS]

        async def traced(request, context):
            with _spans_in_request_traces(method, parents):
                return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


@contextlib.contextmanager
def _spans_in_request_traces(name: str, parents: list[str]) -> Iterator[None]:
    call = trace.get_current_span()
    links = [trace.Link(call.get_span_context())] if call.get_span_context().is_valid else []
    spans = []
    for parent in parents:
        context = _propagator.extract({"traceparent": parent})
        if not trace.get_current_span(context).get_span_context().is_valid:
            continue  # not a traceparent: nothing to hang a span on
        span = tracer("kvtier.grpc").start_span(
            name,
            context=context,
            kind=trace.SpanKind.SERVER,
            links=links,
            attributes={"rpc.system": "grpc", "kvtier.batch_size": len(parents)},
        )
        call.add_link(span.get_span_context())
        spans.append(span)
    with ending(spans):
        yield


@contextlib.contextmanager
def ending(spans: list) -> Iterator[None]:
    """Run the body, then end every span of ``spans``: each marked ERROR, naming the exception,
    when the body raised."""
    try:
        yield
    except BaseException as e:
        for span in spans:
            span.set_status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}")
        raise
    finally:
        for span in spans:
            span.end()


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
