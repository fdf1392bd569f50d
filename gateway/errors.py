"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Everything that goes wrong in the gateway becomes an `APIError`: bad parameters (400), a missing
or wrong API key (401), unknown routes (404), no replica answering (503), gRPC statuses from a
replica (INVALID_ARGUMENT -> 400 with the replica's message). The messages are written for the
HTTP client; nothing in them comes from the node's credentials.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from kvtier.gateway.protocol import ErrorInfo, ErrorResponse
from kvtier.sampling_schema import FIELDS
from kvtier.status import CACHE_UNAVAILABLE, EXCEEDS_LIMIT, reason_of

log = logging.getLogger("kvtier.gateway")

INVALID_REQUEST = "invalid_request_error"
UNAVAILABLE = "service_unavailable_error"
SERVER_ERROR = "server_error"

# gRPC status of a replica's answer -> (HTTP status, OpenAI error type).
_GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, INVALID_REQUEST),
    grpc.StatusCode.OUT_OF_RANGE: (400, INVALID_REQUEST),
    grpc.StatusCode.UNAVAILABLE: (503, UNAVAILABLE),
    grpc.StatusCode.CANCELLED: (503, UNAVAILABLE),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, UNAVAILABLE),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, UNAVAILABLE),
}


# The fields a replica's INVALID_ARGUMENT message starts with -> the request field at fault.
_REPLICA_PARAMS = {spec.name: spec.openai or spec.name for spec in FIELDS} | {
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "cache_salt": "cache_salt",
    "prompt_token_ids": "prompt",
}


def _param_of(message: str) -> str | None:
    """The request field a replica's message names first ("temperature must be ..."), else None."""
    return _REPLICA_PARAMS.get(message.split(" ", 1)[0])


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    @property
    def message(self) -> str:
        return self.info.message

    def body(self) -> bytes:
        return ErrorResponse(error=self.info).model_dump_json().encode()

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def unsupported(fields: dict[str, Any]) -> APIError:
    name, value = next(iter(fields.items()))
    others = f" (also set: {', '.join(list(fields)[1:])})" if len(fields) > 1 else ""
    return bad_request(
        f"'{name}' is not supported yet by kvtier (got {value!r}); leave it unset or at its default{others}",
        param=name,
        code="unsupported_parameter",
    )


def no_replica(detail: str) -> APIError:
    return APIError(503, f"no compute replica is available: {detail}", UNAVAILABLE)


def from_grpc(error: grpc.aio.AioRpcError) -> APIError:
    """A replica's (or the channel's) error status as the HTTP error the client gets."""
    status, kind = _GRPC_STATUS.get(error.code(), (500, SERVER_ERROR))
    if error.code() == grpc.StatusCode.UNAUTHENTICATED:
        # The replicas' keys file differs from the gateway's (it admitted this key): say so.
        return APIError(401, "the compute replica does not accept this API key", code="invalid_api_key")
    details = error.details() or ""
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (
        "over this method's limit" in details or "larger than max" in details
    ):
        # The request itself is too large for the replica (its guard's limit, or grpc's message
        # size on either side): the client's to fix, not a retry.
        return APIError(413, f"the request is too large for the compute replicas: {details}", INVALID_REQUEST)
    if reason_of(error) == EXCEEDS_LIMIT:
        # The request alone needs more KV blocks than its tenant's quota or the pool holds: no
        # retry or other replica helps; the message names the limit.
        return APIError(400, details, INVALID_REQUEST, code="exceeds_limit")
    if reason_of(error) == CACHE_UNAVAILABLE:
        # Not "no replica": the replica is up, the cache service of its node went away.
        return APIError(
            503, f"the compute replica's cache service went away ({details}); retry the request", UNAVAILABLE
        )
    if status == 503:
        return no_replica(f"{error.code().name}: {error.details()}")
    if status == 500:
        # UNAUTHENTICATED, INTERNAL, ...: the gateway's or the replica's fault, not the client's.
        return APIError(500, f"the compute replica failed ({error.code().name}); see the gateway's log", kind)
    return APIError(status, details or error.code().name, kind, _param_of(details))


def from_validation(exc: RequestValidationError) -> APIError:
    """FastAPI's request validation error (wrong types, missing fields, malformed JSON) as a 400."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        )
    param = ".".join(loc) or None
    more = f" ({len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = f"'{param}': " if param else ""
    return bad_request(f"{where}{first['msg']}{more}", param=param)


def install(app: FastAPI) -> None:
    """Make every error the app raises answer in OpenAI's format."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return from_validation(exc).response()

    @app.exception_handler(UnicodeEncodeError)
    async def _lone_surrogate(request: Request, exc: UnicodeEncodeError) -> Response:
        # JSON lets a string escape half a UTF-16 pair ("\ud800"); Python parses it into a str
        # that no UTF-8 encode (a size check, the tokenizer, protobuf) takes. Found wherever a
        # field is first encoded, before any replica is called.
        if exc.reason != "surrogates not allowed":
            return await _unexpected(request, exc)
        return bad_request(
            f"the request holds a lone UTF-16 surrogate (\\u{ord(exc.object[exc.start]):04x}) in a string, which is not "
            "a Unicode character: escape a character past U+FFFF as a high-low pair, or send it as UTF-8",
            code="invalid_unicode",
        ).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), kind, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return APIError(
            500, f"internal error: {type(exc).__name__}; see the gateway's log", SERVER_ERROR
        ).response()
