"""Client API keys: who may call ``Generate`` (and the HTTP gateway), and as which tenant.

Two kinds of credential guard a kvtier node (docs/architecture.md, "Trust model"):

- the *node credential*, the cache service's shared token (``kvtier.auth``): compute replicas and
  routers hold it; it opens every cache RPC;
- *client API keys*, from ``--api-keys FILE``: each belongs to one tenant; they open
  ``ComputeService.Generate`` and the gateway's ``/v1`` routes, and nothing of the cache service.

The file is JSON::

    {"tenants": {
        "acme":   {"keys": ["sk-acme-0123456789abcdef"], "max_blocks": 256, "shared_gib": 4},
        "globex": {"keys": ["sk-globex-0123456789abcdef", "sk-globex-rotated-0123456789"]}
    }}

Tenant names are 1 to 64 characters of ``[A-Za-z0-9._-]``. Each key is at least 16 characters
without whitespace, unique over the whole file, and never the node token. ``max_blocks`` (optional,
>= 1) is the most KV blocks the tenant's live sequences may hold in the cache service
(``python -m kvtier.cachesvc --tenant-quotas FILE`` reads it from the same file). ``shared_gib``
(optional, > 0) is the tenant's quota in the shared tier's Mooncake Store (``kvtier up --shared-tier
--api-keys FILE`` writes the store master's tenant policy from it; a tenant without one gets an even
share of what is left). Unknown fields are errors, so a typo never silently drops a limit.

A presented key is looked up by its SHA-256 digest in a dict: the time a lookup takes does not
depend on how much of a real key the presented one shares.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtier.auth import METADATA_KEY

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MIN_KEY_CHARS = 16
_TENANT_FIELDS = {"keys", "max_blocks", "shared_gib"}
STORE_DEFAULT_TENANT = "kvtier-default"  # Mooncake Store's name for the default tenant ""
STORE_TENANT_PREFIX = (
    "kvtier."  # ... and for tenant t: kvtier.t (valid there: never "_..." nor the default's)
)


def store_tenant(tenant: str) -> str:
    """Mooncake Store's tenant name for kvtier's ``tenant`` (the nodes' clients and the master's policy)."""
    return STORE_TENANT_PREFIX + tenant if tenant else STORE_DEFAULT_TENANT


class ApiKeysError(ValueError):
    """The api-keys file is unusable; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    max_blocks: int | None = None  # most KV blocks its sequences may hold; None = no own limit
    shared_gib: float | None = None  # its quota in the shared tier's store (GiB); None = an even share


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """Key -> tenant, from a parsed api-keys document (use ``load`` for a file)."""

    def __init__(self, tenants: dict[str, Tenant], digests: dict[bytes, str]) -> None:
        self.tenants = tenants
        self._digests = digests

    @classmethod
    def load(cls, path: str | Path, node_token: str | None = None) -> ApiKeys:
        """Read and check ``path``; ApiKeysError names what is wrong (a missing file included)."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ApiKeysError(f"api-keys file {path}: cannot read it ({e.strerror or e})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ApiKeysError(f"api-keys file {path}: not valid JSON ({e})") from None
        return cls.parse(data, str(path), node_token)

    @classmethod
    def parse(cls, data, where: str = "api-keys", node_token: str | None = None) -> ApiKeys:
        """Check a decoded document; ``node_token``, when given, may not be any tenant's key."""
        if not isinstance(data, Mapping) or set(data) != {"tenants"}:
            raise ApiKeysError(f'{where}: expected an object with one field, "tenants"')
        entries = data["tenants"]
        if not isinstance(entries, Mapping) or not entries:
            raise ApiKeysError(f'{where}: "tenants" must be a non-empty object of tenant name -> settings')
        tenants: dict[str, Tenant] = {}
        digests: dict[bytes, str] = {}
        node_digest = _digest(node_token.strip()) if node_token else None
        for name, entry in entries.items():
            at = f"{where}: tenant {name!r}"
            if not TENANT_NAME.fullmatch(name):
                raise ApiKeysError(
                    f"{at}: a tenant name is 1 to 64 characters of letters, digits, '.', '_', '-'"
                )
            if not isinstance(entry, Mapping):
                raise ApiKeysError(f'{at}: expected an object like {{"keys": ["sk-..."]}}')
            if unknown := set(entry) - _TENANT_FIELDS:
                raise ApiKeysError(
                    f"{at}: unknown field(s) {sorted(unknown)}; known: {sorted(_TENANT_FIELDS)}"
                )
            keys = entry.get("keys")
            if not isinstance(keys, list) or not keys:
                raise ApiKeysError(f'{at}: "keys" must be a non-empty list of strings')
            max_blocks = entry.get("max_blocks")
            if max_blocks is not None and (type(max_blocks) is not int or max_blocks < 1):
                raise ApiKeysError(f'{at}: "max_blocks" must be an integer >= 1, got {max_blocks!r}')
            shared_gib = entry.get("shared_gib")
            if shared_gib is not None and (type(shared_gib) not in (int, float) or not shared_gib > 0):
                raise ApiKeysError(f'{at}: "shared_gib" must be a number > 0, got {shared_gib!r}')
            for i, key in enumerate(keys):
                _check_key(f"{at}: keys[{i}]", key)
                d = _digest(key)
                if d == node_digest:
                    raise ApiKeysError(
                        f"{at}: keys[{i}] is the node token; client keys must differ from the node credential"
                    )
                if d in digests:
                    other = digests[d]
                    raise ApiKeysError(
                        f"{at}: keys[{i}] is already a key of "
                        f"{'this tenant' if other == name else f'tenant {other!r}'}; each key names one tenant"
                    )
                digests[d] = name
            tenants[name] = Tenant(name, max_blocks, shared_gib)
        return cls(tenants, digests)

    def tenant_of(self, key: str) -> str | None:
        """The tenant ``key`` belongs to; None for an unknown key."""
        return self._digests.get(_digest(key))

    def quotas(self) -> dict[str, int]:
        """Tenant -> max_blocks, for the tenants that have one."""
        return {t.name: t.max_blocks for t in self.tenants.values() if t.max_blocks is not None}


def _check_key(where: str, key) -> None:
    if not isinstance(key, str):
        raise ApiKeysError(f"{where} must be a string, got {type(key).__name__}")
    if not key.strip():
        raise ApiKeysError(f"{where} is blank")
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key) or not key.isprintable():
        raise ApiKeysError(
            f"{where}: a key is at least {MIN_KEY_CHARS} printable characters without whitespace "
            "(make one with `python -c 'import secrets; print(\"sk-\" + secrets.token_urlsafe(24))'`)"
        )


def presented_key(metadata) -> str | None:
    """The bearer credential a call's metadata carries (``authorization: Bearer <x>``), or None."""
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:]
    return None


def tenant_salt(tenant: str, cache_salt: str) -> str:
    """The salt a tenant's sequence is hashed with: derived from the tenant AND the client's salt.

    The default tenant "" keeps ``cache_salt`` as it is (single-user stacks, and hashes recorded
    before tenants existed, stay the same). Any other tenant's salt is a digest of the
    length-prefixed pair, so no (tenant, salt) pair can produce another tenant's chain whatever
    salt it sends. A router asking LookupPrefix for a tenant's prompt hashes with this too.
    """
    if not tenant:
        return cache_salt
    t = tenant.encode()
    digest = hashlib.sha256(b"kvtier-tenant-salt-v1\0" + len(t).to_bytes(4, "big") + t + cache_salt.encode())
    return f"tenant:{digest.hexdigest()}"


class ClientKeys:
    """The credential of ``ComputeService.Generate`` when keys are configured (a
    ``kvtier.call_guard.Credential``): a client key admits its tenant; the node token is refused
    unless ``node_token`` is given (``--allow-node-token``), and then admits the default tenant "".
    """

    def __init__(self, keys: ApiKeys, node_token: str | None = None) -> None:
        self.keys = keys
        self._node_digest = _digest(node_token) if node_token else None

    def identify(self, metadata) -> str | None:
        key = presented_key(metadata)
        if key is None:
            return None
        tenant = self.keys.tenant_of(key)
        if tenant is None and self._node_digest is not None and _digest(key) == self._node_digest:
            return ""
        return tenant

    def refusal(self, method: str) -> str:
        return (
            f"{method}: missing or unknown API key; send metadata 'authorization: Bearer <api key>' "
            "with a key of your tenant (this service takes client API keys, not the node token)"
        )
