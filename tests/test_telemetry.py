"""Trace context crosses processes over gRPC, and tracing is truly off when nothing asks for it.

Each process under test is a real subprocess with its own environment, so the global tracer
provider of one never leaks into another (or into pytest).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvtier import __version__

ROOT = Path(__file__).resolve().parent.parent

# A grpc.aio server with only the health service, traced by kvtier.telemetry. It stops when its
# stdin closes, so the test ends it deterministically and atexit flushes its spans.
SERVER = """
import asyncio, sys
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvtier import telemetry

async def main(addr):
    telemetry.setup_tracing("default-server-name")
    server = grpc.aio.server(interceptors=telemetry.aio_server_interceptors())
    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(addr)
    await server.start()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(grace=1)

asyncio.run(main(sys.argv[1]))
"""

# A client that calls Check inside a span of its own, over the channel kind given in argv[2].
CLIENT = """
import asyncio, sys
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtier import telemetry

addr, kind = sys.argv[1], sys.argv[2]
assert telemetry.setup_tracing("test-client")
tracer = telemetry.tracer("test")

async def call_aio():
    async with telemetry.aio_channel(addr) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status

with tracer.start_as_current_span("client-root"):
    if kind == "aio":
        status = asyncio.run(call_aio())
    else:
        with telemetry.sync_channel(addr) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
assert status == health_pb2.HealthCheckResponse.SERVING, status
"""


class OtlpReceiver:
    """A real OTLP trace receiver: decodes each ExportTraceServiceRequest into span dicts
    (trace_id, span_id, parent_id as hex; name; service.name; service.version)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.requests = 0
        self._lock = threading.Lock()

    def take(self, body: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        with self._lock:
            self.requests += 1
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append(
                            {
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_id": span.parent_span_id.hex(),
                                "name": span.name,
                                "service": resource.get("service.name"),
                                "version": resource.get("service.version"),
                            }
                        )

    def names(self) -> set[str]:
        with self._lock:
            return {s["name"] for s in self.spans}


@pytest.fixture
def otlp_http():
    """An OTLP/HTTP receiver on 127.0.0.1 (POST /v1/traces, protobuf); yields (receiver, endpoint)."""
    receiver = OtlpReceiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            ok = self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
            if ok:
                receiver.take(body)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield receiver, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def otlp_grpc():
    """An OTLP/gRPC receiver (TraceService/Export) on 127.0.0.1; yields (receiver, endpoint)."""
    receiver = OtlpReceiver()

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the RPC's name)
            receiver.take(request.SerializeToString())
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, f"http://127.0.0.1:{port}"
    finally:
        server.stop(None)


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without any tracing switch, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "KVTIER_TRACE_FILE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def read_spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_until_serving(addr: str, deadline_s: float = 20.0) -> None:
    """Block until the server answers its health check (wait_for_ready: no sleeping)."""
    with grpc.insecure_channel(addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=deadline_s, wait_for_ready=True
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def traced_server(tmp_path: Path):
    """A traced health server on a Unix socket; yields (address, its span file)."""
    addr = f"unix://{tmp_path}/health.sock"
    span_file = tmp_path / "server.jsonl"
    env = clean_env(KVTIER_TRACE_FILE=str(span_file), OTEL_SERVICE_NAME="kvtier-test-server")
    proc = subprocess.Popen([sys.executable, "-c", SERVER, addr], stdin=subprocess.PIPE, env=env)
    try:
        wait_until_serving(addr)
        yield addr, span_file
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=20) == 0


@pytest.mark.parametrize("kind", ["aio", "sync"])
def test_server_span_is_child_of_client_span_across_processes(traced_server, tmp_path: Path, kind: str):
    addr, server_file = traced_server
    client_file = tmp_path / "client.jsonl"
    subprocess.run(
        [sys.executable, "-c", CLIENT, addr, kind],
        env=clean_env(KVTIER_TRACE_FILE=str(client_file)),
        check=True,
        timeout=60,
    )
    client_spans = read_spans(client_file)
    root = next(s for s in client_spans if s["name"] == "client-root")
    rpc_client = next(s for s in client_spans if s["kind"] == "SpanKind.CLIENT")
    assert rpc_client["name"] == "/grpc.health.v1.Health/Check"
    assert rpc_client["parent_id"] == root["context"]["span_id"]
    assert rpc_client["resource"]["attributes"]["service.name"] == "test-client"

    # NOTE: the server exports its span (SimpleSpanProcessor) when the handler returns, before the
    # reply is sent, so the line is in the file once the client has its answer. The readiness
    # probe's call came from an untraced client: its server span is a root, left out here.
    server_spans = read_spans(server_file)
    rpc_server = [s for s in server_spans if s["kind"] == "SpanKind.SERVER" and s["parent_id"]]
    assert len(rpc_server) == 1, server_spans
    assert rpc_server[0]["name"] == "/grpc.health.v1.Health/Check"
    assert rpc_server[0]["context"]["trace_id"] == root["context"]["trace_id"]
    assert rpc_server[0]["parent_id"] == rpc_client["context"]["span_id"]
    assert rpc_server[0]["resource"]["attributes"]["service.name"] == "kvtier-test-server"


def test_tracing_is_off_and_sdk_unloaded_without_otel_variables():
    probe = """
import json, sys
import grpc
from opentelemetry import trace
from kvtier import telemetry
installed = telemetry.setup_tracing("kvtier-test")
channel = telemetry.sync_channel("localhost:1")
print(json.dumps({
    "installed": installed,
    "again": telemetry.setup_tracing("kvtier-test"),
    "provider": type(trace.get_tracer_provider()).__name__,
    "tracer": type(telemetry.tracer("x")).__name__,
    "sdk_loaded": "opentelemetry.sdk.trace" in sys.modules,
    "instrumentation_loaded": "opentelemetry.instrumentation.grpc" in sys.modules,
    "aio_interceptors": telemetry.aio_server_interceptors(),
    "sync_interceptors": telemetry.server_interceptors(),
    "plain_channel": type(channel) is grpc._channel.Channel,
}))
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], env=clean_env(), check=True, capture_output=True, text=True, timeout=60
    )
    assert json.loads(out.stdout) == {
        "installed": False,
        "again": False,
        "provider": "ProxyTracerProvider",
        "tracer": "ProxyTracer",
        "sdk_loaded": False,
        "instrumentation_loaded": False,
        "aio_interceptors": [],
        "sync_interceptors": [],
        "plain_channel": True,
    }


def test_otel_sdk_disabled_wins_over_trace_file(tmp_path: Path):
    probe = "from kvtier import telemetry; print(telemetry.setup_tracing('kvtier-test'))"
    env = clean_env(KVTIER_TRACE_FILE=str(tmp_path / "t.jsonl"), OTEL_SDK_DISABLED="true")
    out = subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize(
    ("generic", "per_signal", "receiver"),
    [
        ("http/protobuf", "grpc", "otlp_grpc"),
        ("grpc", "http/protobuf", "otlp_http"),
        ("http/protobuf", "", "otlp_http"),
    ],
)
def test_otlp_protocol_variables_choose_the_exporter(tmp_path: Path, request, generic, per_signal, receiver):
    """The per-signal protocol wins over the generic one; the spans reach a receiver of that
    protocol only at shutdown (a 10-minute batch delay), so the services' exit flushes them."""
    spans, endpoint = request.getfixturevalue(receiver)
    addr = f"unix://{tmp_path}/health.sock"
    env = clean_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL=generic,
        OTEL_BSP_SCHEDULE_DELAY="600000",
        OTEL_SERVICE_NAME="kvtier-test-server",
    )
    if per_signal:
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = per_signal
    proc = subprocess.Popen([sys.executable, "-c", SERVER, addr], stdin=subprocess.PIPE, env=env)
    try:
        wait_until_serving(addr)
        assert spans.requests == 0  # batched: nothing leaves before shutdown
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=20) == 0
    checks = [s for s in spans.spans if s["name"] == "/grpc.health.v1.Health/Check"]
    assert checks, spans.spans
    assert {(s["service"], s["version"]) for s in checks} == {("kvtier-test-server", __version__)}


def test_unknown_otlp_protocol_is_refused():
    probe = "from kvtier import telemetry; telemetry.setup_tracing('kvtier-test')"
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1", OTEL_EXPORTER_OTLP_PROTOCOL="http/json")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "OTLP protocol 'http/json': kvtier exports traces over grpc or http/protobuf" in out.stderr


def test_a_batched_call_names_the_sampled_requests_it_serves_in_one_metadata_entry():
    """telemetry.request_metadata: nothing outside for_requests; inside, one entry of W3C
    traceparents (sampled spans only, at most MAX_REQUEST_CONTEXTS) after the call's own."""
    from opentelemetry import trace

    from kvtier import telemetry

    def span(trace_id: int, sampled: bool = True) -> trace.Span:
        flags = trace.TraceFlags(trace.TraceFlags.SAMPLED if sampled else 0)
        return trace.NonRecordingSpan(trace.SpanContext(trace_id, 7, is_remote=False, trace_flags=flags))

    own = (("authorization", "Bearer x"),)
    assert telemetry.request_metadata(own) == own
    with telemetry.for_requests([span(1), span(2, sampled=False), trace.INVALID_SPAN, span(3)]):
        *kept, (key, value) = telemetry.request_metadata(own)
    assert tuple(kept) == own and key == telemetry.REQUEST_CONTEXTS_KEY
    assert value.split(",") == [f"00-{t:032x}-{7:016x}-01" for t in (1, 3)]
    assert telemetry.request_metadata(own) == own  # closed again
    with telemetry.for_requests([span(t) for t in range(1, 200)]):
        (_, value) = telemetry.request_metadata(())[-1]
    assert len(value.split(",")) == telemetry.MAX_REQUEST_CONTEXTS


# A traced sync client following a real cache service's block events (as the vLLM connector's block
# index does), its stream cancelled from another thread: the iteration ends.
WATCHER = """
import sys, threading
from kvtier import telemetry
from kvtier.cache_client import CacheClient
from kvtier.cache_errors import CacheCallError

assert telemetry.setup_tracing("test-watcher")
client = CacheClient.connect(sys.argv[1], sys.argv[2], timeout_s=30)
client.attach("watcher")
[seq] = client.allocate([[5] * 32])
client.free([seq.sequence_id], [(seq.sequence_id, [], 32)])
stream = client.watch_events(0)
first = next(stream)
ended = threading.Event()

def follow():
    try:
        for _ in stream:
            pass
    except CacheCallError as e:
        print("ended:", e.code, flush=True)
    ended.set()

threading.Thread(target=follow, daemon=True).start()
stream.cancel()
assert ended.wait(30), "cancel() did not end the stream"
print("event", first[0])
"""


def test_a_traced_client_s_block_event_stream_ends_on_cancel(tiny_model_dir, tmp_path: Path):
    from servers import TOKEN, cache_service

    with cache_service(tmp_path / "run", "--model", str(tiny_model_dir), "--num-blocks", "16") as cache:
        out = subprocess.run(
            [sys.executable, "-c", WATCHER, cache.address, TOKEN],
            env=clean_env(KVTIER_TRACE_FILE=str(tmp_path / "client.jsonl")),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ended: CANCELLED" in out.stdout and "event 1" in out.stdout, out.stdout
    # The stream is not traced (one span as long as a follower says nothing); the calls before it are.
    names = {span["name"] for span in read_spans(tmp_path / "client.jsonl")}
    assert "/kvtier.v1.CacheService/Allocate" in names and not any("WatchEvents" in n for n in names), names
