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


TENANT_SUBJECT = "tenant:"
"""Prefix of a ``google.rpc.QuotaFailure`` violation's subject naming the tenant whose own quota
or fair share refused more blocks (the pool may have room): its replica preempts that tenant's
own sequences, not another tenant's (``quota_tenant_of``)."""


def details_trailer(
    code, message: str, reason: str = "", quota_tenant: str | None = None
) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata for a status ``code`` (a grpc.StatusCode) carrying ``ErrorInfo(reason)``
    when a reason is given, and a ``QuotaFailure`` naming ``quota_tenant`` when one is."""
    status = status_pb2.Status(code=code.value[0], message=message)
    if reason:
        status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN))
    if quota_tenant is not None:
        violation = error_details_pb2.QuotaFailure.Violation(
            subject=TENANT_SUBJECT + quota_tenant, description=message
        )
        status.details.add().Pack(error_details_pb2.QuotaFailure(violations=[violation]))
    return ((rpc_status.GRPC_DETAILS_METADATA_KEY, status.SerializeToString()),)


def _details(error, kind) -> list:
    """The details of type ``kind`` (a protobuf message class) of a failed call, in order."""
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # details that disagree with the call's code: not ours
        return []
    found = []
    for detail in status.details if status is not None else ():
        if detail.Is(kind.DESCRIPTOR):
            found.append(kind())
            detail.Unpack(found[-1])
    return found


def reason_of(error) -> str:
    """The ``ErrorInfo`` reason of a failed call (a grpc.RpcError / grpc.aio.AioRpcError), or ""."""
    return next((i.reason for i in _details(error, error_details_pb2.ErrorInfo) if i.domain == DOMAIN), "")


def quota_tenant_of(error) -> str | None:
    """The tenant a failed call's ``QuotaFailure`` names (``TENANT_SUBJECT``), or None."""
    for failure in _details(error, error_details_pb2.QuotaFailure):
        for violation in failure.violations:
            if violation.subject.startswith(TENANT_SUBJECT):
                return violation.subject.removeprefix(TENANT_SUBJECT)
    return None
