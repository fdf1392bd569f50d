"""What every kvtier gRPC server shares: listening (Unix socket, TCP, TLS), the per-call guard
(kvtier.call_guard: credential check, request size limits, decoding, RPC timing) put in front of
every method, health and reflection, the OpenTelemetry interceptor, and a clean stop on
SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from kvtier import telemetry
from kvtier.auth import ensure_run_dir
from kvtier.call_guard import CallGuard, Credential

log = logging.getLogger("kvtier.server")

# The most any message may be, either way, unless a service sets tighter per-method limits (then
# grpc refuses what is over the largest of them before any of our code runs).
MAX_MESSAGE_BYTES = 128 << 20


def return_large_buffers_to_the_os(threshold_bytes: int = 1 << 20) -> bool:
    """Have glibc's malloc map every allocation of `threshold_bytes` or more on its own, so it goes
    back to the OS when freed; False where that cannot be set (not glibc).

    NOTE: glibc raises its mmap threshold (up to 32 MiB) each time such a buffer is freed, after
    which request-sized buffers (grpc's receive buffers, the request's bytes) come from heaps
    that keep the memory: a few refused multi-MB requests left ~40 MiB resident in the cache
    service; with the threshold fixed at 1 MiB, ~10 MiB. For a process whose large allocations
    are requests, not one where they are tensors allocated every step.
    """
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(-3, threshold_bytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        # Clients probe a stream's connection with keepalive pings (kvtier.compute_client.KEEPALIVE,
        # every 5 s, also between calls); without these, grpc counts pings more often than every
        # 5 minutes as abuse and closes the connection (GOAWAY too_many_pings; tests/test_keepalive.py).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ]


class AddressInUse(OSError):
    """Another live server already listens where this one was asked to."""


def bind(
    server: grpc.aio.Server, listen: str, tls_cert: str | None = None, tls_key: str | None = None
) -> str:
    """Bind `listen` (unix:///path or tcp://host:port); returns the address clients should dial."""
    if listen.startswith("unix://"):
        path = Path(listen[len("unix://") :])
        # Created owner-only if missing; refused (auth.UntrustedPath) if it is another user's or
        # others can write it: they could move our socket aside and take the token of a client.
        ensure_run_dir(path.parent)
        clear_stale_socket(path)
        # NOTE: grpc creates and binds the socket here. The umask makes it 0600 from its creation
        # (a chmod after would leave a window, and would follow a link put in its place). The
        # umask is the process's: a file another thread creates meanwhile is only made tighter.
        umask = os.umask(0o177)
        try:
            server.add_insecure_port(f"unix://{path}")
        finally:
            os.umask(umask)
        return f"unix://{path}"
    host_port = listen[len("tcp://") :] if listen.startswith("tcp://") else listen
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    try:
        if tls_cert:
            creds = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
            port = server.add_secure_port(host_port, creds)
        else:
            port = server.add_insecure_port(host_port)
    except RuntimeError:  # grpc's "Failed to bind"; the reason is only in its debug log
        port = 0
    if port == 0:
        raise AddressInUse(f"cannot listen on {listen}: the port is in use or the host is not this machine's")
    host = host_port.rsplit(":", 1)[0]
    return f"{host}:{port}"


def clear_stale_socket(path: Path) -> None:
    """Remove a socket file that no server listens on any more; refuse a live one or a non-socket.

    A socket file outlives a killed server. Unlinking it blindly would take the address from a
    server that is still running (its clients would then reach the newcomer), so the file is
    removed only when a connection to it is refused.
    """
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise AddressInUse(f"{path} exists and is not a socket; remove it or choose another --listen")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s (no server answers on it)", path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    finally:
        probe.close()
    raise AddressInUse(
        f"a live server already listens on {path}: stop it first (kvtier down, or SIGTERM) or "
        "choose another --listen"
    )


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def add_reflection(guard: CallGuard, service_names: list[str]) -> None:
    """Server reflection under both its names, ``v1`` (what current grpcurl asks first) and
    ``v1alpha`` (what older clients ask).

    NOTE: grpcio-reflection ships only the v1alpha servicer; the v1 protocol is the same messages
    in another package, byte for byte, so the same servicer answers both. enable_server_reflection()
    picks the aio servicer by isinstance(server, grpc.aio.Server), which the guard is not, so the
    aio servicer is registered here directly.
    """
    servicer = reflection.aio.ReflectionServicer([*service_names, REFLECTION_V1, reflection.SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, guard)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    guard.add_registered_method_handlers(REFLECTION_V1, {"ServerReflectionInfo": v1})


async def start_server(
    service_name: str,
    add_servicers,
    listen: str,
    token: str,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    metrics=None,
    credentials: dict[str, Credential] | None = None,
    max_request_bytes: dict[str, int] | None = None,
    raw_checks: dict[str, Callable[[bytes], str | None]] | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    """Create, bind and start an aio server; `add_servicers(guard)` registers the service's own.

    `add_servicers` receives a `CallGuard` to hand to the generated ``add_*_to_server`` in place
    of the server. With `metrics` (cachesvc.metrics.CacheMetrics / computesvc.metrics.ComputeMetrics), every RPC's
    latency is recorded per method and status code. `credentials`, `max_request_bytes`,
    `raw_checks`: see `CallGuard`; with `max_request_bytes`, grpc itself refuses (RESOURCE_EXHAUSTED) any message
    over the largest of them, so no request bigger than that is ever buffered whole.
    """
    if not token or not token.strip():
        raise ValueError("the service token is empty: every call would pass the token check")
    receive_limit = max(max_request_bytes.values()) if max_request_bytes else MAX_MESSAGE_BYTES
    # Only OTel's interceptor stays an interceptor; everything of ours is the guard, wrapped
    # into each handler at registration.
    server = grpc.aio.server(
        interceptors=telemetry.aio_server_interceptors() or None, options=server_options(receive_limit)
    )
    guard = CallGuard(
        server,
        token,
        metrics,
        credentials=credentials,
        max_request_bytes=max_request_bytes,
        raw_checks=raw_checks,
    )
    add_servicers(guard)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, guard)
    add_reflection(guard, [service_name, health.SERVICE_NAME])
    address = bind(server, listen, tls_cert, tls_key)
    await server.start()
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
