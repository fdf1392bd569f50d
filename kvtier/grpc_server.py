"""What every kvtier gRPC server shares: listening (Unix socket, TCP, TLS), the token check,
health and reflection, OpenTelemetry interceptors, and a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtier import telemetry
from kvtier.auth import TokenInterceptor, ensure_run_dir
from kvtier.metrics import RpcMetricsInterceptor

log = logging.getLogger("kvtier.server")

# Generous but bounded: a 1k-sequence batch of 8k-token prompts is ~70 MB of int64s.
MAX_MESSAGE_BYTES = 128 << 20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Answer undecodable request bytes with INVALID_ARGUMENT instead of grpc's UNKNOWN.

    The handler receives raw bytes and this wrapper parses them, so a corrupt message is
    refused with a status a client can act on before any service code runs.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        def guarded(behavior):
            async def decode(raw: bytes, context):
                try:
                    return parse(raw)
                except Exception as e:  # protobuf's DecodeError, or anything a parser raises
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{method}: the request is not a valid message ({e})",
                    )

            if handler.response_streaming:

                async def stream(raw, context):
                    request = await decode(raw, context)
                    async for reply in behavior(request, context):
                        yield reply

                return stream

            async def unary(raw, context):
                return await behavior(await decode(raw, context), context)

            return unary

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                guarded(handler.unary_stream), response_serializer=handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            guarded(handler.unary_unary), response_serializer=handler.response_serializer
        )


def bind(
    server: grpc.aio.Server, listen: str, tls_cert: str | None = None, tls_key: str | None = None
) -> str:
    """Bind `listen` (unix:///path or tcp://host:port); returns the address clients should dial."""
    if listen.startswith("unix://"):
        path = Path(listen[len("unix://") :])
        if not path.parent.exists():
            ensure_run_dir(path.parent)  # a directory we create is owner-only
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a socket file left by a killed server
        server.add_insecure_port(f"unix://{path}")
        return f"unix://{path}"
    host_port = listen[len("tcp://") :] if listen.startswith("tcp://") else listen
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        creds = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
        port = server.add_secure_port(host_port, creds)
    else:
        port = server.add_insecure_port(host_port)
    if port == 0:
        raise OSError(f"could not bind {listen}")
    host = host_port.rsplit(":", 1)[0]
    return f"{host}:{port}"


def restrict_socket(address: str) -> None:
    """Owner-only permissions on a Unix socket (the token is the second line of defence)."""
    if address.startswith("unix://"):
        os.chmod(address[len("unix://") :], 0o600)


async def start_server(
    service_name: str,
    add_servicers,
    listen: str,
    token: str,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    metrics=None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    """Create, bind and start an aio server; `add_servicers(server)` registers the service's own.

    With `metrics` (kvtier.metrics.CacheMetrics / ComputeMetrics), every RPC's latency is
    recorded per method and status code.
    """
    interceptors = [*telemetry.aio_server_interceptors()]
    if metrics is not None:
        interceptors.append(RpcMetricsInterceptor(metrics))
    interceptors.append(TokenInterceptor(token))
    interceptors.append(DecodeGuard())
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = bind(server, listen, tls_cert, tls_key)
    await server.start()
    restrict_socket(address)
    await health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, address


async def wait_for_termination(server: grpc.aio.Server, health_servicer, grace_s: float = 2.0) -> None:
    """Serve until SIGTERM/SIGINT, then report NOT_SERVING and stop with a grace period."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.ensure_future(server.wait_for_termination())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("stopping (signal received)")
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace_s)
    serving.cancel()
    stopping.cancel()
