"""What every kvtier gRPC server shares: listening (Unix socket, TCP, TLS), the per-call guard
(token check, request decoding, RPC timing), health and reflection, the OpenTelemetry
interceptor, and a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import inspect
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from kvtier import telemetry
from kvtier.auth import ensure_run_dir, token_matches
from kvtier.metrics import RpcObserver, rpc_status_name

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
        # 5 minutes as abuse and closes the connection (GOAWAY too_many_pings).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ]


# Services that answer without the token: they reveal nothing a caller could use.
OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
)


# The identity the guard admitted the current call as (its tenant; "" for the node credential and
# open methods). Set by the guard before the handler runs, in the call's own task.
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("kvtier_caller", default="")


def caller() -> str:
    """The tenant the running call was admitted as ("" = node credential, or no client keys)."""
    return _CALLER.get()


class Credential(Protocol):
    """What a guarded method accepts: ``identify`` returns the caller's tenant, None to refuse."""

    def identify(self, metadata) -> str | None: ...
    def refusal(self, method: str) -> str: ...


class NodeToken:
    """The node credential: the cache service's shared token, admitted as tenant ""."""

    def __init__(self, token: str) -> None:
        self._token = token

    def identify(self, metadata) -> str | None:
        return "" if token_matches(metadata, self._token) else None

    def refusal(self, method: str) -> str:
        return (
            f"{method}: missing or wrong token; send metadata 'authorization: Bearer <token>' "
            "(the token is in $KVTIER_TOKEN or the service's token file)"
        )


class CallGuard:
    """Credential check, request decoding and RPC timing, applied once per method when it is registered.

    Pass the guard to the generated ``add_*_to_server(servicer, guard)`` in place of the server:
    every method handler is wrapped on its way in, so a call runs one wrapper and no per-call
    interceptor chain (grpc.aio runs each interceptor's coroutine, and re-wraps the handler, on
    every call). Per call the wrapper

    - refuses a call without the method's credential with UNAUTHENTICATED (PERMISSION_DENIED is
      for a caller who is known but may not touch what it names). A method needs the node token
      unless `credentials` names another `Credential` for it (the compute service's Generate
      takes client API keys: kvtier.api_keys.ClientKeys); the tenant it identifies is `caller()`
      while the handler runs. Health and server reflection stay open, so orchestrators probe
      readiness and `grpcurl list` works without the secret; every data RPC needs one,
    - refuses a request over its method's byte limit (`max_request_bytes`) with
      RESOURCE_EXHAUSTED on the raw bytes, after the credential and before parsing, then runs
      the method's `raw_checks` on them (a message: INVALID_ARGUMENT, still unparsed),
    - parses the raw request bytes itself, so undecodable bytes get INVALID_ARGUMENT instead of
      grpc's UNKNOWN before any service code runs,
    - times unary and server-streaming calls into ``metrics.observe_rpc(short method name,
      seconds, status name)``; client-streaming calls (reflection) are only token-checked.
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        token: str,
        metrics: RpcObserver | None = None,
        open_prefixes: tuple[str, ...] = OPEN_SERVICES,
        credentials: dict[str, Credential] | None = None,
        max_request_bytes: dict[str, int] | None = None,
        raw_checks: dict[str, Callable[[bytes], str | None]] | None = None,
    ) -> None:
        """`credentials`: full method name (``/package.Service/Method``) -> what it accepts in
        place of the node token. `max_request_bytes`: full method name -> the largest request
        it takes, in serialized bytes (methods not named: grpc's receive limit only).
        `raw_checks`: full method name -> a check of the raw request that returns what is wrong
        with it, or None (it must cost far less than parsing)."""
        self._server = server
        self._node = NodeToken(token)
        self._metrics = metrics
        self._open = open_prefixes
        self._credentials = dict(credentials or {})
        self._max_bytes = dict(max_request_bytes or {})
        self._raw_checks = dict(raw_checks or {})

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        """What generated code calls; these handlers win over generic ones for their methods."""
        self._server.add_registered_method_handlers(
            service_name,
            {
                name: self.wrap(f"/{service_name}/{name}", handler)
                for name, handler in method_handlers.items()
            },
        )

    def add_generic_rpc_handlers(self, generic_rpc_handlers) -> None:
        """Generic handlers resolve per call, so each is wrapped on first use of a method."""
        self._server.add_generic_rpc_handlers([_GuardedGenericHandler(self, h) for h in generic_rpc_handlers])

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The guarded handler for `method` (``/package.Service/Method``)."""
        credential = None if method.startswith(self._open) else self._credentials.get(method, self._node)
        # Client-streaming calls (reflection) are not timed, as before the guard.
        observe = None if self._metrics is None or handler.request_streaming else self._metrics.observe_rpc
        limits = (self._max_bytes.get(method), self._raw_checks.get(method))
        return _GuardedMethod(method, handler, credential, observe, *limits).handler


class _GuardedMethod:
    """One method's wrapper; everything that does not depend on the call is computed here, once."""

    __slots__ = (
        "_behavior",
        "_parse",
        "_credential",
        "_denied",
        "_method",
        "_short_name",
        "_observe",
        "_max_bytes",
        "_raw_check",
        "handler",
    )

    def __init__(
        self,
        method: str,
        handler: grpc.RpcMethodHandler,
        credential: Credential | None,
        observe: Callable[[str, float, str], None] | None,
        max_bytes: int | None = None,
        raw_check: Callable[[bytes], str | None] | None = None,
    ) -> None:
        """`credential` None leaves the method open; `observe` None leaves it untimed; `max_bytes`
        None leaves the request's size to grpc's receive limit; `raw_check`: see CallGuard."""
        behavior = next(
            b
            for b in (handler.unary_unary, handler.unary_stream, handler.stream_unary, handler.stream_stream)
            if b is not None
        )
        if inspect.isgeneratorfunction(behavior):
            raise TypeError(f"{method}: a streaming handler must be async (got {behavior!r})")
        is_generator = inspect.isasyncgenfunction(behavior)
        if not (is_generator or inspect.iscoroutinefunction(behavior)):
            behavior = _run_inline(behavior)
        self._behavior = behavior
        self._method = method
        self._short_name = method.rsplit("/", 1)[-1]
        self._credential = credential
        self._denied = credential.refusal(method) if credential is not None else ""
        # Streamed requests are parsed by grpc as they arrive; only a unary request is ours to parse.
        self._parse = None if handler.request_streaming else handler.request_deserializer
        self._observe = observe
        # A streamed request has no raw bytes to measure: grpc's receive limit bounds each message.
        self._max_bytes = None if handler.request_streaming else max_bytes
        self._raw_check = None if handler.request_streaming else raw_check
        # grpc.aio drives an async generator with `async for` and awaits a coroutine (a streaming
        # one writes with context.write), telling them apart by function type: keep the kind.
        run = self.stream if is_generator else self.call
        ser = handler.response_serializer
        if handler.request_streaming:
            make = (
                grpc.stream_stream_rpc_method_handler
                if handler.response_streaming
                else grpc.stream_unary_rpc_method_handler
            )
            self.handler = make(run, handler.request_deserializer, ser)
        elif handler.response_streaming:
            self.handler = grpc.unary_stream_rpc_method_handler(run, response_serializer=ser)
        else:
            self.handler = grpc.unary_unary_rpc_method_handler(run, response_serializer=ser)

    def _admit(self, raw, context):
        """The parsed request, or `_Refused` naming why the call may not run."""
        if self._credential is not None:
            tenant = self._credential.identify(context.invocation_metadata())
            if tenant is None:
                raise _Refused(grpc.StatusCode.UNAUTHENTICATED, self._denied)
            _CALLER.set(tenant)
        if self._max_bytes is not None and len(raw) > self._max_bytes:
            raise _Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._method}: the request is {len(raw)} bytes, over this method's limit of "
                f"{self._max_bytes} bytes; send fewer or shorter items (the service derives the "
                "limit from the largest request it accepts; --max-request-bytes sets it)",
            )
        if self._raw_check is not None and (wrong := self._raw_check(raw)) is not None:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{self._method}: {wrong}")
        if self._parse is None:
            return raw
        try:
            return self._parse(raw)
        except Exception as e:  # protobuf's DecodeError, or anything a parser raises
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"{self._method}: the request is not a valid message ({e})"
            ) from None

    def _admit_or_refusal(self, raw, context):
        """``(request, None)``, or ``(None, _Refused)`` of a call that may not run.

        NOTE: the caller aborts outside any ``except`` block and drops ``raw`` first. Aborting
        inside one chains the abort to the refusal, whose traceback holds the frames that hold
        ``raw`` (up to grpc's receive limit), and kept an exception in a local that its own
        traceback's frame refers to: a cycle that kept every refused request alive until a
        garbage-collector pass.
        """
        try:
            return self._admit(raw, context), None
        except _Refused as refused:
            refused.__traceback__ = None
            return None, refused

    async def call(self, raw, context):
        """Unary response, or a streaming handler that writes with context.write()."""
        start, error = perf_counter(), None
        try:
            request, refused = self._admit_or_refusal(raw, context)
            raw = None
            if refused is not None:
                await context.abort(refused.code, refused.details)
            # Only the handler's frame holds the request: an abort's traceback holds this frame.
            handling, request = self._behavior(request, context), None
            return await handling
        except BaseException as e:
            error = e
            raise
        finally:
            if self._observe is not None:
                self._observe(self._short_name, perf_counter() - start, rpc_status_name(context, error))
            error = None  # the exception's traceback holds this frame: no cycle through it

    async def stream(self, raw, context):
        """Streaming response from an async generator handler."""
        start, error = perf_counter(), None
        try:
            request, refused = self._admit_or_refusal(raw, context)
            raw = None
            if refused is not None:
                await context.abort(refused.code, refused.details)
            replies, request = self._behavior(request, context), None
            async for reply in replies:
                yield reply
        except BaseException as e:
            error = e
            raise
        finally:
            if self._observe is not None:
                self._observe(self._short_name, perf_counter() - start, rpc_status_name(context, error))
            error = None  # as in call()


def _run_inline(behavior: Callable):
    """A sync handler as a coroutine, run on the event loop.

    NOTE: our servicers are all async; the sync ones are generated "not implemented" stubs (e.g.
    health's List) that set UNIMPLEMENTED and raise at once, so an executor hop is not worth it.
    """

    async def run(request, context):
        return behavior(request, context)

    return run


class _Refused(Exception):
    """A call refused before service code runs, with the status it is answered with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _GuardedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose methods are wrapped on first use and the wrapper kept."""

    def __init__(self, guard: CallGuard, inner: grpc.GenericRpcHandler) -> None:
        self._guard = guard
        self._inner = inner
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details):
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        seen = self._wrapped.get(method)
        if seen is None or seen[0] is not handler:
            seen = self._wrapped[method] = (handler, self._guard.wrap(method, handler))
        return seen[1]


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
