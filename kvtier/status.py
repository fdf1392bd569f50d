"""Machine-readable reasons on gRPC error statuses, as ``google.rpc.ErrorInfo`` details.

A status code says what kind of failure happened; some callers must also tell two failures of
one code apart (an unknown *sequence* and an expired *lease* are both NOT_FOUND, but only the
second means "attach again"). The service attaches an ``ErrorInfo`` with a reason from this
module to the status (gRPC's rich error model: the ``grpc-status-details-bin`` trailer, which
grpcurl and every gRPC library can read), and the caller reads it with ``reason_of``: never by
matching the message text, which is for people.
"""

from __future__ import annotations

from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "kvtier.v1"

LEASE_EXPIRED = "LEASE_EXPIRED"
"""The call named a lease the cache service does not hold (expired, or the service restarted)."""

EXCEEDS_LIMIT = "EXCEEDS_LIMIT"
"""RESOURCE_EXHAUSTED that waiting cannot cure: the request alone needs more blocks than a quota
(its tenant's, the per-lease limit) or the whole pool holds."""


CACHE_UNAVAILABLE = "CACHE_UNAVAILABLE"
"""UNAVAILABLE from a compute replica whose node's cache service went away (it is re-attaching):
the request can be retried, on another node at once."""


def details_trailer(code, message: str, reason: str) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata carrying ``ErrorInfo(reason)`` for a status ``code`` (a grpc.StatusCode)."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    return ((rpc_status.GRPC_DETAILS_METADATA_KEY, status.SerializeToString()),)


def reason_of(error) -> str:
    """The ``ErrorInfo`` reason of a failed call (a grpc.RpcError / grpc.aio.AioRpcError), or ""."""
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # details that disagree with the call's code: not ours
        return ""
    if status is None:
        return ""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                return info.reason
    return ""
