"""Errors raised by the cache service's domain code, one class per gRPC status code.

Domain code raises them where a problem is detected, with a message that names the offending
value and the limit it broke ("items[3].token_ids[17] = 70000 is out of range [0, 50257)").
The servicer maps each class to its status code in one place; the domain never imports gRPC.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error the cache service reports to a caller."""


class InvalidArgument(CacheError):
    """Bad shape, negative count, token id out of range, oversized batch (INVALID_ARGUMENT)."""


class NotFound(CacheError):
    """Unknown sequence (NOT_FOUND)."""


class LeaseExpired(NotFound):
    """The call names a lease this service does not hold: expired, or never opened here (the
    service restarted). NOT_FOUND like an unknown sequence, but the caller must Attach again, so
    the status also carries the reason ``kvtier.status.LEASE_EXPIRED``."""


class ResourceExhausted(CacheError):
    """No device blocks even after eviction, or no host-tier room: the caller preempts (RESOURCE_EXHAUSTED)."""


class ExceedsLimit(ResourceExhausted):
    """One item alone needs more blocks than its tenant's quota, the per-lease limit or the whole
    pool: it can never fit, so waiting will not help. RESOURCE_EXHAUSTED with the reason
    ``kvtier.status.EXCEEDS_LIMIT``."""


class TenantLimit(ResourceExhausted):
    """A tenant's own quota or fair share refused more blocks (the pool may have room):
    RESOURCE_EXHAUSTED with a ``google.rpc.QuotaFailure`` naming the tenant
    (``kvtier.status.quota_tenant_of``), so its replica preempts that tenant's own sequences."""

    def __init__(self, message: str, tenant: str):
        super().__init__(message)
        self.tenant = tenant


class PermissionDenied(CacheError):
    """The sequence belongs to another lease (PERMISSION_DENIED)."""


class FailedPrecondition(CacheError):
    """The sequence is in the wrong place for the call, e.g. swapped out (FAILED_PRECONDITION)."""
