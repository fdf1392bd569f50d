"""The connector's settings: ``kv_connector_extra_config`` first, then the environment, then defaults.

| key (extra config) | environment | default | meaning |
| --- | --- | --- | --- |
| ``cache_address`` | ``KVTIER_CACHE_ADDRESS`` | the run directory's ``cache.sock`` | the cache service (unix:///path, tcp://host:port) |
| ``token_file`` | ``KVTIER_TOKEN_FILE`` (``KVTIER_TOKEN`` = the token itself) | the run directory's ``token`` | the node credential |
| ``tls_ca`` | ``KVTIER_TLS_CA`` | none | CA certificate for a TLS cache service |
| ``rpc_timeout_s`` | ``KVTIER_RPC_TIMEOUT_S`` | 5 | deadline of each cache call (a lookup answers "no hit" after it) |
| ``attach_timeout_s`` | ``KVTIER_ATTACH_TIMEOUT_S`` | 60 | how long startup waits for the cache service before vLLM stops |
| ``max_reserved_share`` | ``KVTIER_MAX_RESERVED_SHARE`` | 0.25 | share of the pool's blocks this engine may hold for prompts that arrived and are not computed yet (each gets its pool blocks on arrival; past the share, when vLLM schedules it) |
| ``save_batch_ms`` | ``KVTIER_SAVE_BATCH_MS`` | 50 | how long the scheduler side gathers written saves before it publishes them all in one Free (the cache's cost is mostly per call: a save is published up to this much later; 0: each at once) |
| ``lookup_wait_ms`` | ``KVTIER_LOOKUP_WAIT_MS`` | 5 | how long one scheduler step waits for lookups' answers, all together (0: never; unanswered requests wait for the next step) |
| ``block_index`` | ``KVTIER_BLOCK_INDEX`` | true | follow the cache's block events to answer a prompt whose first block it never announced as a miss without asking (``kvtier.vllm.block_index``; about 100 bytes per cached block; the cache streams the events to each engine that follows, many a message). Off: every prompt is asked on arrival, and vLLM's scheduler waits for the answer |
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, fields
from typing import Any

from kvtier import auth

_KEYS = {
    "cache_address": "KVTIER_CACHE_ADDRESS",
    "token_file": "KVTIER_TOKEN_FILE",
    "tls_ca": "KVTIER_TLS_CA",
    "rpc_timeout_s": "KVTIER_RPC_TIMEOUT_S",
    "attach_timeout_s": "KVTIER_ATTACH_TIMEOUT_S",
    "max_reserved_share": "KVTIER_MAX_RESERVED_SHARE",
    "lookup_wait_ms": "KVTIER_LOOKUP_WAIT_MS",
    "save_batch_ms": "KVTIER_SAVE_BATCH_MS",
    "block_index": "KVTIER_BLOCK_INDEX",
}
_MAY_BE_ZERO = {"lookup_wait_ms", "save_batch_ms"}
_GONE = {"max_staged_save_mib": "saves are no longer staged in the engine: see max_reserved_share"}


@dataclass(frozen=True)
class ConnectorConfig:
    cache_address: str
    token_file: str | None = None
    tls_ca: str | None = None
    rpc_timeout_s: float = 5.0
    attach_timeout_s: float = 60.0
    max_reserved_share: float = 0.25
    lookup_wait_ms: float = 5.0
    save_batch_ms: float = 50.0
    block_index: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Settings from vLLM's ``kv_connector_extra_config`` (unknown keys refused, naming them)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            gone = "".join(f"; {key}: {_GONE[key]}" for key in unknown if key in _GONE)
            raise ValueError(
                f"kvtier connector: unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(_KEYS)}{gone}"
            )

        def pick(key: str):
            value = extra.get(key)
            return value if value is not None else os.environ.get(_KEYS[key]) or None

        numbers = {}
        for key in (f.name for f in fields(cls) if isinstance(f.default, float)):
            raw = pick(key)
            if raw is None:
                continue
            try:
                numbers[key] = float(raw)
            except (TypeError, ValueError):
                raise ValueError(f"kvtier connector: {key} = {raw!r} is not a number") from None
            if numbers[key] < 0 or (numbers[key] == 0 and key not in _MAY_BE_ZERO):
                raise ValueError(
                    f"kvtier connector: {key} must be {'>=' if key in _MAY_BE_ZERO else '>'} 0, got {raw!r}"
                )
        if numbers.get("max_reserved_share", 0.0) > 1:
            raise ValueError(
                f"kvtier connector: max_reserved_share must be at most 1, got {pick('max_reserved_share')!r}"
            )
        flags = {}
        raw = pick("block_index")
        if raw is not None:
            flag = str(raw).strip().lower()
            if flag not in ("true", "false", "1", "0"):
                raise ValueError(f"kvtier connector: block_index = {raw!r} is not true or false")
            flags["block_index"] = flag in ("true", "1")
        return cls(
            cache_address=pick("cache_address") or auth.default_cache_address(),
            token_file=pick("token_file"),
            tls_ca=pick("tls_ca"),
            **numbers,
            **flags,
        )

    def token(self) -> str:
        """The node credential ($KVTIER_TOKEN, the token file, or the run directory's)."""
        token = auth.load_token(self.token_file)
        if token is None:
            raise RuntimeError(
                "kvtier connector: no cache service token: set token_file in kv_connector_extra_config, "
                f"$KVTIER_TOKEN or $KVTIER_TOKEN_FILE (the run directory's is {auth.default_token_file()})"
            )
        return token


def client_name(role: str) -> str:
    """How this engine's leases show in the cache service's stats: ``vllm-<role>@host:pid``."""
    return f"vllm-{role}@{socket.gethostname()}:{os.getpid()}"
