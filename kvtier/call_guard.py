"""The per-call guard of every kvtier gRPC server: the credential check (the node token, or
another `Credential` per method, and the tenant it admits: `caller()`), per-method request size
limits and raw checks, request decoding (undecodable bytes: INVALID_ARGUMENT) and RPC timing,
wrapped once into each method handler as it is registered."""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from time import perf_counter
from typing import Protocol

import grpc

from kvtier.auth import token_matches
from kvtier.metrics import RpcObserver, rpc_status_name

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
