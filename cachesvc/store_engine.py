"""What every tenant's Mooncake Store client in a process shares: where the store is
(``StoreAddress``), the one transfer engine (``StoreEngine``) and the circuit breaker
(``Breaker``); ``cachesvc.store_client`` makes the calls (tenant names: ``kvtier.api_keys.store_tenant``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

log = logging.getLogger("kvtier.cache")

SCHEME = "mooncake"
DEFAULT_MASTER_PORT = 50051  # mooncake_master's --rpc_port default
DEFAULT_METADATA_PORT = 8080  # mooncake_master's --http_metadata_server_port default
PROBE_KEY = "kvtier-probe"  # a key no object has: the probe asks whether it exists
TENANT_QUOTA_EXCEEDED = -1700  # Mooncake's ErrorCode: the put would take the tenant over its quota
TENANT_NOT_REGISTERED = -1701  # strict multi-tenant mode, a tenant missing from the master's policy


@dataclass(frozen=True)
class StoreAddress:
    """Where the store is: its master's RPC address and its metadata server's URL."""

    master: str  # host:port of mooncake_master's RPC
    metadata: str  # http://host:port/metadata (the master's built-in HTTP metadata server)

    @classmethod
    def parse(cls, url: str, metadata: str = "") -> StoreAddress:
        """``mooncake://HOST[:PORT]`` (port default 50051); ``metadata`` default
        ``http://HOST:8080/metadata``. ValueError naming the value otherwise."""
        parts = urlsplit(url)
        if parts.scheme != SCHEME or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"--shared-tier {url!r} is not mooncake://HOST[:PORT]")
        try:
            port = parts.port or DEFAULT_MASTER_PORT
        except ValueError:
            raise ValueError(f"--shared-tier {url!r}: the port is not a number in 1..65535") from None
        host = parts.hostname
        if not metadata:
            metadata = f"http://{host}:{DEFAULT_METADATA_PORT}/metadata"
        elif urlsplit(metadata).scheme not in ("http", "https"):
            raise ValueError(f"--shared-tier-metadata {metadata!r} is not an http:// URL")
        return cls(f"{host}:{port}", metadata)


class Breaker:
    """Closed (calls go to the store) or open (they answer at once); ``clock`` is monotonic seconds."""

    def __init__(self, probe_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.probe_s = probe_s
        self.clock = clock
        self.open = True  # until the client connects
        self.reason = "not connected yet"
        self.opened_at = clock()
        self.times_opened = 0
        self.epoch = 0  # times it closed: what a caller knew of the store before may be gone
        self._warned = False  # a WARNING was logged since the breaker last closed

    def trip(self, reason: str) -> None:
        """Open the breaker (a WARNING the first time: the node serves from its own tiers)."""
        if not self.open:
            self.times_opened += 1
        if not self._warned:
            self._warned = True
            log.warning(
                "shared tier: %s; serving from this node's tiers and recomputing (probing every %g s)",
                reason,
                self.probe_s,
            )
        self.open, self.reason, self.opened_at = True, reason, self.clock()

    def close(self) -> None:
        if self.open:
            log.info("shared tier: the store answers again (%s before)", self.reason)
            self.epoch += 1
        self.open, self.reason, self._warned = False, "", False

    def probe_due(self) -> bool:
        """Whether an open breaker should try the store again now (and restarts its wait)."""
        if self.open and self.clock() - self.opened_at >= self.probe_s:
            self.opened_at = self.clock()
            return True
        return False


def engine_name(hostname: str) -> str:
    """``hostname`` with a port of its own (one free now), unless it names one: the engine's name in
    the metadata server. Every engine needs its own: two nodes on one host both named 127.0.0.1
    (Mooncake's default port 12001) collide, the second's registration is refused ("Duplicate
    rpc_meta key") and its tier stays down until a retry, which then took over the first's entry."""
    if hostname.rpartition(":")[2].isdigit():
        return hostname
    with socket.socket() as s:
        s.bind(("", 0))
        return f"{hostname}:{s.getsockname()[1]}"


class StoreEngine:
    """The one Mooncake transfer engine of a process, shared by every tenant's client: started by
    the first client to connect, under a name of its own (``engine_name``: the clients' setup uses
    it too); buffers registered with it once, for all of them."""

    def __init__(self) -> None:
        self._engine = None
        self.name = ""  # once started
        self._lock = threading.Lock()
        self._registered: set[int] = set()

    def handle(self, hostname: str, metadata: str):
        """The engine for ``setup(engine=...)``, started on first use (each try under a new
        ``engine_name`` of ``hostname``); None if it could not start."""
        with self._lock:
            if self._engine is None:
                from mooncake.engine import TransferEngine

                engine, name = TransferEngine(), engine_name(hostname)
                if engine.initialize(name, metadata, "tcp", "") != 0:
                    return None
                self._engine, self.name = engine, name
            return self._engine.get_engine()

    def register(self, ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``ptr`` once (0, or the engine's error)."""
        with self._lock:
            if ptr in self._registered:
                return 0
            rc = self._engine.register_memory(ptr, size) if self._engine is not None else -1
            if rc == 0:
                self._registered.add(ptr)
            return rc
