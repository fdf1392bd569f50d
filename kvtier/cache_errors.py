"""What a call to the cache service raises, for every client of it (the compute replica's
`BlockCache` port, vLLM's connector, the router, the CLI, tests).

`kvtier.cache_client.CacheClient` turns each gRPC status into one of these (`call_error`), so a
caller tells "no room" from "the service is gone" by type and never imports gRPC. Nothing here
imports gRPC: the compute scheduler catches these in plain Python.

    CacheCallError            any failed call; ``code`` names the gRPC status ("NOT_FOUND")
      NoFreeBlocks            RESOURCE_EXHAUSTED: no room now, preempt or wait
        ExceedsLimit          ... with reason EXCEEDS_LIMIT: it can never fit, fail it
        TenantLimited         ... with a QuotaFailure naming a tenant: that tenant's own limit
      CacheUnavailable        UNAVAILABLE, DEADLINE_EXCEEDED, or NOT_FOUND with reason
                              LEASE_EXPIRED: retryable, attach again
      InvalidRequest          INVALID_ARGUMENT (also a ValueError): the call's items were refused
"""

from __future__ import annotations


class CacheCallError(Exception):
    """A call the cache service refused or did not answer.

    ``code``: the gRPC status's name ("PERMISSION_DENIED", "OUT_OF_RANGE", ...; "" for an error
    raised without a call, as an in-process cache raises NoFreeBlocks). ``reason``: the status's
    ErrorInfo reason (``kvtier.status``), "" when it carries none. ``details``: the service's own
    message (the exception's message may add the code before it).
    """

    def __init__(self, message: str, code: str = "", reason: str = "", details: str | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.details = message if details is None else details


class NoFreeBlocks(CacheCallError):
    """The cache has no room for this call (RESOURCE_EXHAUSTED): preempt or wait."""


class ExceedsLimit(NoFreeBlocks):
    """The request can never fit (RESOURCE_EXHAUSTED with reason EXCEEDS_LIMIT): it alone needs
    more blocks than its tenant's quota, the per-lease limit or the whole pool. Fail it at once."""


class TenantLimited(NoFreeBlocks):
    """A tenant's own quota or fair share refused the room, not the pool (RESOURCE_EXHAUSTED with a
    QuotaFailure naming `tenant`): preempt that tenant's own sequences, freeing them (a quota
    counts the host tier's blocks too)."""

    def __init__(self, message: str, tenant: str, code: str = ""):
        super().__init__(message, code)
        self.tenant = tenant


class CacheUnavailable(CacheCallError):
    """The cache service cannot be reached (or restarted and forgot our lease): retryable."""


class InvalidRequest(CacheCallError, ValueError):
    """The service refused the call's arguments (INVALID_ARGUMENT): bad counts, token ids out of
    range, oversized lists. A ValueError, so a caller that retries a batch item by item catches
    it as it catches its own validation."""
