"""One lease on the cache service, kept alive from threads: what each side of the connector holds.

vLLM calls the connector from its scheduler loop and its model runner, both synchronous, so this
uses kvtier's sync CacheClient. The link attaches at startup (waiting up to ``attach_timeout_s``
for the service: a wrong address or token stops vLLM there), renews the lease from a heartbeat
thread, and when the service goes away (its socket refuses, or it no longer knows the lease: it
restarted) it drops the client and re-attaches in the background, every second at most, for as
long as the engine runs. Meanwhile ``call`` raises ``CacheDown`` at once, so no caller waits on a
service that is not there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.cache_client import CacheClient
from kvtier.cache_errors import CacheCallError, CacheUnavailable
from kvtier.pool import PoolSpec
from kvtier.vllm import LOGGER
from kvtier.vllm.config import ConnectorConfig, client_name

log = logging.getLogger(LOGGER)

RECONNECT_MAX_DELAY_S = 1.0


class CacheDown(ConnectionError):
    """The cache service cannot be used now (down, restarting, or slower than the call's deadline)."""


class CacheLink:
    """A lease on the cache service for one side (``role``: ``scheduler`` or ``worker``) of one engine.

    ``on_attached(client)`` hooks run after every attach, the first included (the worker maps the
    pool there). ``valid_until()`` is the lease's deadline on the ``time.monotonic`` clock, from the
    last renewal's send time: KV read or written under the lease is trusted only before it.
    """

    def __init__(self, cfg: ConnectorConfig, role: str):
        self.cfg = cfg
        self.role = role
        self.client: CacheClient | None = None
        self.generation = 0  # attaches so far; a client from an older one is never renewed again
        self.on_attached: list[Callable[[CacheClient], None]] = []
        # Run on every attach's pool spec before it is used; raising refuses it (at startup, vLLM stops).
        self.check: Callable[[PoolSpec], None] = lambda spec: None
        self._token = cfg.token()
        self._lock = threading.Lock()
        self._valid_until = 0.0
        self._stop_heartbeat: threading.Event | None = None
        self._reconnecting = False
        self._closed = False

    # ------------------------------------------------------------ attach

    def start(self) -> CacheClient:
        """Attach, waiting up to ``attach_timeout_s`` for the service; raises ConnectionError after."""
        deadline = time.monotonic() + self.cfg.attach_timeout_s
        delay = 0.1
        while True:
            try:
                return self._attach_once()
            except CacheDown as e:
                if time.monotonic() + delay > deadline:
                    raise ConnectionError(
                        f"kvtier connector: cannot reach the cache service at {self.cfg.cache_address} after "
                        f"{self.cfg.attach_timeout_s:.0f}s ({e}); start it first (kvtier cache --model DIR)"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_DELAY_S)

    def _attach_once(self) -> CacheClient:
        client = CacheClient.connect(
            self.cfg.cache_address, self._token, tls_ca=self.cfg.tls_ca, timeout_s=self.cfg.rpc_timeout_s
        )
        sent_at = time.monotonic()
        try:
            client.attach(client_name(self.role))
        except CacheCallError as e:
            client.close()
            if e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                raise CacheDown(f"Attach: {e.code}: {e.details}") from None
            raise ConnectionError(
                f"kvtier connector: the cache service at {self.cfg.cache_address} refused Attach: "
                f"{e.code}: {e.details}"
            ) from None
        try:
            self.check(client.pool)
        except Exception:
            client.close()
            raise
        with self._lock:
            self.generation += 1
            generation = self.generation
            old, self.client = self.client, client
            self._valid_until = sent_at + client.lease_ttl_s
            if self._stop_heartbeat is not None:
                self._stop_heartbeat.set()
            self._stop_heartbeat = client.start_heartbeat_thread(
                on_renewed=lambda at: self._renewed(generation, at),
                on_lost=lambda error: self._lost(generation, error),
            )
        if old is not None:
            old.close()
        for hook in self.on_attached:
            hook(client)
        log.info(
            "kvtier %s attached to %s: lease %s…, pool %s %s, %d blocks of %d tokens",
            self.role,
            self.cfg.cache_address,
            client.lease_id[:8],
            client.pool.backend,
            client.pool.dtype,
            client.pool.num_blocks,
            client.pool.block_size,
        )
        return client

    def _renewed(self, generation: int, sent_at: float) -> None:
        with self._lock:
            if generation == self.generation and self.client is not None:
                self._valid_until = max(self._valid_until, sent_at + self.client.lease_ttl_s)

    def _lost(self, generation: int, error: Exception) -> None:
        with self._lock:
            if generation != self.generation or self.client is None:
                return
            client, self.client = self.client, None
            self._valid_until = 0.0
            if self._stop_heartbeat is not None:
                self._stop_heartbeat.set()
            start = not self._reconnecting and not self._closed
            self._reconnecting = self._reconnecting or start
        client.close()
        log.warning(
            "kvtier %s lost the cache service at %s (%s): lookups miss and saves are dropped until it is back",
            self.role,
            self.cfg.cache_address,
            error,
        )
        if start:
            threading.Thread(
                target=self._reconnect, name=f"kvtier-{self.role}-reconnect", daemon=True
            ).start()

    def _reconnect(self) -> None:
        delay = 0.1
        while not self._closed:
            try:
                self._attach_once()
                break
            except CacheDown:
                time.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_DELAY_S)
            except Exception as e:  # refused: say so and keep trying, the engine serves without us
                log.error("kvtier %s: re-attach failed: %s", self.role, e)
                time.sleep(RECONNECT_MAX_DELAY_S)
        with self._lock:
            self._reconnecting = False

    # ------------------------------------------------------------ calls

    @property
    def attached(self) -> bool:
        return self.client is not None

    def valid_until(self) -> float:
        return self._valid_until

    def snapshot(self) -> tuple[int, PoolSpec | None]:
        """(the current attach's generation, its pool spec); the spec is None while detached."""
        with self._lock:
            return self.generation, None if self.client is None else self.client.pool

    def call(self, method: Callable[[CacheClient], object], expect_generation: int | None = None):
        """``method(client)`` (one RPC); its reply. CacheDown when the service is not attached (or,
        with ``expect_generation``, attached again since: the sequences of that lease are gone), went
        away (the link then re-attaches) or missed the deadline; other CacheCallErrors propagate."""
        with self._lock:
            client, generation = self.client, self.generation
        if client is None or expect_generation not in (None, generation):
            raise CacheDown(f"not attached to the cache service at {self.cfg.cache_address}")
        sent_at = time.monotonic()
        try:
            reply = method(client)
        except CacheUnavailable as e:  # gone, forgot the lease (restarted), or past the deadline
            if e.code != "DEADLINE_EXCEEDED":
                self._lost(generation, ConnectionError(f"{e.code}: {e.details}"))
            raise CacheDown(f"{e.code}: {e.details}") from None
        self._renewed(generation, sent_at)  # every call renews the lease on the service
        return reply

    def close(self) -> None:
        self._closed = True
        with self._lock:
            client, self.client = self.client, None
            if self._stop_heartbeat is not None:
                self._stop_heartbeat.set()
        if client is not None:
            client.close()
