"""A Mooncake Store client whose every call is bounded: the shared tier's only way to the store.

Mooncake's Python client (``mooncake.store.MooncakeDistributedStore``, from the
``mooncake-transfer-engine-non-cuda`` wheel: the ``kvtier[mooncake]`` extra) blocks in C++: with
its master down a get or a put waits about 4 s for the connection to fail, and ``setup`` retries
for 90 s. So nothing here calls it on the caller's thread:

- ``connect`` runs ``setup`` on a thread of its own and retries it until it succeeds (the node
  starts, serves and recomputes meanwhile);
- reads (``exists``, ``get``) run on one reader thread and the caller waits at most
  ``timeout_s``; a read still running past that is abandoned (its result is dropped) and the
  tier counts as down;
- writes (``put``) go onto a bounded queue that one writer thread drains; a full queue drops
  the object (counted), so a caller never waits for a write.

``Breaker`` is the circuit breaker around all three: a failed or late call opens it (one
WARNING naming the cause), calls made while it is open answer at once (a miss, a dropped write),
and every ``probe_s`` one probe read is tried off the caller's thread; when it answers, the
breaker closes (one INFO line) and the tier serves again. No request waits on a dead store.

Tenants: a Mooncake client is bound to one tenant at ``setup``. Under the master's strict
multi-tenant mode (``--enable_multi_tenants``, which ``kvtier up --api-keys`` turns on) a tenant's
objects count against its quota and live in its own namespace. ``for_tenant`` makes another
tenant's client on the same ``StoreEngine`` (one transfer engine per process: one TCP port, one
registration of the pool) sharing the same breaker (the store is down for every tenant at once).
kvtier's tenant ``t`` is Mooncake's ``kvtier.t``, the default tenant "" is ``kvtier-default``
(``store_tenant``). A put refused for the tenant's quota (TENANT_QUOTA_EXCEEDED) or for a tenant
the master does not know (TENANT_NOT_REGISTERED) is counted (``quota_refused``,
``unregistered_tenant``) with one WARNING per client, and does not open the breaker: the store
serves every other tenant on.

The client is imported lazily (``connect``), so kvtier runs without the wheel when the shared
tier is off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kvtier.api_keys import store_tenant
from kvtier.cachesvc.store_engine import (
    PROBE_KEY,
    TENANT_NOT_REGISTERED,
    TENANT_QUOTA_EXCEEDED,
    Breaker,
    StoreAddress,
    StoreEngine,
)

log = logging.getLogger("kvtier.cache")

COUNTS = (
    "timeouts", "errors", "dropped_writes", "failed_writes", "writes", "quota_refused", "unregistered_tenant",
)  # fmt: skip


class StoreUnavailable(ValueError):
    """The store cannot be used (its client is not installed); names why. A ValueError: the
    service's ``main`` reports it as "cannot start: ..." as it does a bad flag."""


class StoreClient:
    """Bounded calls on one Mooncake Store client (module docstring), as kvtier's ``tenant``.

    ``segment_bytes``: the memory this process lends the store (0: it only reads and writes;
    the store's memory is its store servers'). ``buffer_bytes``: the client's local transfer
    buffer. ``timeout_s``: the longest a caller waits for a read. ``queue_objects``: writes
    waiting for the writer; more are dropped. ``engine`` and ``breaker``: shared with the other
    tenants' clients (``for_tenant``); new ones by default.
    """

    def __init__(
        self,
        address: StoreAddress,
        *,
        segment_bytes: int = 0,
        buffer_bytes: int = 64 << 20,
        timeout_s: float = 0.5,
        probe_s: float = 5.0,
        queue_objects: int = 256,
        hostname: str = "",
        tenant: str = "",
        engine: StoreEngine | None = None,
        breaker: Breaker | None = None,
    ) -> None:
        if timeout_s <= 0 or probe_s <= 0 or queue_objects <= 0 or segment_bytes < 0 or buffer_bytes <= 0:
            raise ValueError(
                f"shared tier timeout {timeout_s} s, probe {probe_s} s, queue {queue_objects}, "
                f"segment {segment_bytes} B, buffer {buffer_bytes} B: each must be > 0 (segment >= 0)"
            )
        self.address = address
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.timeout_s = timeout_s
        self.queue_objects = queue_objects
        self.hostname = hostname or _local_hostname(address.master)
        self.tenant = tenant
        self.engine = engine or StoreEngine()
        self.breaker = breaker or Breaker(probe_s)
        self.counts = dict.fromkeys(COUNTS, 0)
        self._refused: set[int] = set()  # the tenant refusals already logged (one WARNING each)
        self._store = None
        self.ready = threading.Event()  # set once connected
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-store-read")
        self._reading: Future | None = None  # the read in flight (one at a time)
        self._queue: deque[tuple[str, list | Callable[[], list], Callable | None]] = deque()
        self._writing = False  # the writer holds an object it took off the queue
        self._cond = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-store-write", daemon=True)

    def for_tenant(self, tenant: str, buffer_bytes: int) -> StoreClient:
        """kvtier's ``tenant``'s client on this one's store, engine and breaker (lending no
        memory: this client's segment is the node's), connecting in the background."""
        client = StoreClient(
            self.address,
            buffer_bytes=buffer_bytes,
            timeout_s=self.timeout_s,
            probe_s=self.breaker.probe_s,
            queue_objects=self.queue_objects,
            hostname=self.hostname,
            tenant=tenant,
            engine=self.engine,
            breaker=self.breaker,
        )
        client.connect()
        return client

    # -- connecting ---------------------------------------------------------------------------

    def connect(self) -> None:
        """Start connecting in the background (StoreUnavailable at once if the client is missing)."""
        os.environ.setdefault("GLOG_minloglevel", "2")  # the C++ client's INFO lines: not ours to print
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StoreUnavailable(
                f"--shared-tier needs Mooncake Store's client ({e}); install kvtier[mooncake] "
                "(and the Debian packages libibverbs1 librdmacm1): scripts/setup.sh does both"
            ) from None
        threading.Thread(
            target=self._connect_loop,
            args=(MooncakeDistributedStore,),
            name="kvtier-store-setup",
            daemon=True,
        ).start()

    def _connect_loop(self, store_class) -> None:
        while not self._closed:
            store = store_class()
            engine = self.engine.handle(self.hostname, self.address.metadata)
            rc = "no transfer engine" if engine is None else store.setup(
                self.engine.name, self.address.metadata, self.segment_bytes, self.buffer_bytes, "tcp", "",
                self.address.master, engine, False, "", store_tenant(self.tenant),
            )  # fmt: skip
            if rc == 0:
                self._store = store
                self.ready.set()
                self._writer.start()
                log.info(
                    "shared tier: connected to mooncake://%s as tenant %s (metadata %s, lending %d MiB)",
                    self.address.master,
                    store_tenant(self.tenant),
                    self.address.metadata,
                    self.segment_bytes >> 20,
                )
                self.breaker.close()
                return
            self.breaker.trip(f"cannot connect to the store's master {self.address.master} (setup: {rc})")
            time.sleep(self.breaker.probe_s)

    @property
    def connected(self) -> bool:
        return self._store is not None

    @property
    def available(self) -> bool:
        """Whether calls go to the store now; an open breaker past its wait sends one probe."""
        if self._store is None:
            return False
        if self.breaker.open and self.breaker.probe_due() and self._idle():
            self._reading = self._reader.submit(self._probe)
        return not self.breaker.open

    def _idle(self) -> bool:
        return self._reading is None or self._reading.done()

    def _probe(self) -> None:
        if self._store.is_exist(PROBE_KEY) >= 0:
            self.breaker.close()

    # -- reads ----------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool] | None:
        """Whether each of ``keys`` is in the store, or None (down, late: counted as a miss)."""
        codes = self._read(self._store_exists, list(keys), "exists")
        if codes is not None and TENANT_NOT_REGISTERED in codes:
            self._refuse(TENANT_NOT_REGISTERED)
            return [False] * len(codes)
        if codes is None or any(c < 0 for c in codes):
            if codes is not None:
                self._fail("errors", f"exists answered {min(codes)}")
            return None
        return [c == 1 for c in codes]

    def get(self, keys: Sequence[str]) -> list[bytes] | None:
        """The objects under ``keys`` (``b""`` for one the store does not hold), or None."""
        return self._read(self._store_get, list(keys), "get")

    def get_into(
        self, keys: Sequence[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int] | None:
        """Each object of ``keys`` scattered into its buffers (``ptrs[i]``, ``sizes[i]`` bytes each,
        in order: the object's bytes end to end), or None; per key its size, or < 0 (missing)."""
        return self._read(
            lambda k: self._store.batch_get_into_multi_buffers(k, ptrs, sizes), list(keys), "get"
        )

    def register(self, ptr: int, size: int) -> bool:
        """Register ``size`` bytes at ``ptr`` with the transfer engine once (gets land there
        without a bounce through the client's buffer); False if it refused or did not answer."""
        return self._read(lambda _: self.engine.register(ptr, size), ["register"], "register") == 0

    def remove(self, keys: Sequence[str]) -> list[bool] | None:
        """Remove ``keys`` from the store (whatever leases hold them); per key whether it was there."""
        codes = self._read(self._store_remove, list(keys), "remove")
        return None if codes is None else [c == 0 for c in codes]

    def _store_remove(self, keys: list[str]) -> list[int]:
        return self._store.batch_remove(keys, True)

    def _store_exists(self, keys: list[str]) -> list[int]:
        return self._store.batch_is_exist(keys)

    def _store_get(self, keys: list[str]) -> list[bytes]:
        return self._store.get_batch(keys)

    def _read(self, call, keys: list[str], what: str):
        if not keys or not self.available:
            return None
        if not self._idle():  # an earlier read is still stuck in the store
            self._fail("timeouts", f"a {what} waits behind a read still running after {self.timeout_s} s")
            return None
        self._reading = future = self._reader.submit(call, keys)
        try:
            return future.result(self.timeout_s)
        except FutureTimeout:
            self._fail("timeouts", f"a {what} of {len(keys)} objects took over {self.timeout_s} s")
        except Exception as e:  # the client's own errors: a miss, never the caller's failure
            self._fail("errors", f"{what} failed: {e}")
        return None

    def _fail(self, count: str, reason: str) -> None:
        self.counts[count] += 1
        self.breaker.trip(reason)

    # -- writes ---------------------------------------------------------------------------------

    def put(
        self, key: str, parts: list | Callable[[], list], done: Callable[[bool], object] | None = None
    ) -> bool:
        """Queue one object (``parts``: bytes-like, stored one after another, or a function the
        writer calls for them: work kept off the caller's thread); False if dropped. ``done(ok)``
        is called on the writer's thread once the put succeeded or failed."""
        if not self.available or self._closed:
            return False
        with self._cond:
            if len(self._queue) >= self.queue_objects:
                self.counts["dropped_writes"] += 1
                return False
            self._queue.append((key, parts, done))
            self._cond.notify()
        return True

    @property
    def queue_depth(self) -> int:
        """Objects not stored yet: queued, or the one being put (0: every put has returned)."""
        with self._cond:
            return len(self._queue) + self._writing

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                key, parts, done = self._queue.popleft()
                self._writing = True
            try:
                ok = self._put(key, parts)
                if done is not None:
                    done(ok)
            finally:
                self._writing = False

    def _put(self, key: str, parts: list | Callable[[], list]) -> bool:
        if self.breaker.open:
            self.counts["dropped_writes"] += 1
            return False
        started = time.monotonic()
        try:
            rc = self._store.put_parts(key, *(parts() if callable(parts) else parts))
        except Exception as e:  # noqa: BLE001 - reported as the tier down
            rc = f"{type(e).__name__}: {e}"
        took = time.monotonic() - started
        if rc == 0:
            self.counts["writes"] += 1
            return True
        if rc in (TENANT_QUOTA_EXCEEDED, TENANT_NOT_REGISTERED):  # this tenant's, not the store's
            self._refuse(rc)
            return False
        # The store full (no segment has room) or unreachable: writes stop until a probe
        # answers; reads may still hit what it holds.
        self.counts["failed_writes"] += 1
        self.breaker.trip(f"a put failed ({rc}) after {took:.2f} s")
        return False

    def _refuse(self, rc: int) -> None:
        """A put (or read) refused for this tenant (``rc``): counted, one WARNING per kind; the
        breaker stays closed (other tenants' calls go on)."""
        quota = rc == TENANT_QUOTA_EXCEEDED
        self.counts["quota_refused" if quota else "unregistered_tenant"] += 1
        if rc in self._refused:
            return
        self._refused.add(rc)
        why = (
            "is at its quota and its objects there are in use (TENANT_QUOTA_EXCEEDED)" if quota
            else "is not in the master's tenant policy (TENANT_NOT_REGISTERED; kvtier up --api-keys writes one)"
        )  # fmt: skip
        log.warning(
            "shared tier: tenant %s %s: its blocks are not stored there", store_tenant(self.tenant), why
        )

    def wait_written(self, deadline_s: float = 10.0) -> bool:
        """Wait until the write queue is empty (tests, benchmarks and shutdown); False at the deadline."""
        deadline = time.monotonic() + deadline_s
        while self.queue_depth and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.queue_depth

    def stats(self) -> dict:
        return {
            **self.counts,
            "available": not self.breaker.open,
            "times_down": self.breaker.times_opened,
            "queue_depth": self.queue_depth,
        }

    def close(self, release: bool = False) -> None:
        """Write what the queue holds (a few seconds at most), then stop the threads; with
        ``release`` also wait for a read in flight and close Mooncake's client (its transfer
        buffer freed: a tenant's client retired while the process goes on)."""
        if self._store is not None and not self.breaker.open:
            self.wait_written(5.0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._reader.shutdown(wait=release, cancel_futures=True)
        if release and self._store is not None:
            self._store.close()


class TenantClients:
    """Every tenant's client on one store: ``default`` (kvtier's tenant "", lending the node's
    segment, always open) and at most ``max_open`` named tenants' (``for_tenant``, opened on first
    use with ``buffer_bytes`` of transfer buffer; the least recently used closed first, its
    counts kept)."""

    def __init__(self, default: StoreClient, max_open: int, buffer_bytes: int) -> None:
        self.default = default
        self.max_open = max_open
        self.buffer_bytes = min(default.buffer_bytes, buffer_bytes)
        self._named: OrderedDict[str, StoreClient] = OrderedDict()
        self._closed_counts = dict.fromkeys(COUNTS, 0)

    def of(self, tenant: str) -> StoreClient:
        """``tenant``'s client. A new one is waited for (its ``setup``, some milliseconds on the
        process's running transfer engine) at most the reads' timeout while the store is up."""
        if not tenant:
            return self.default
        named = self._named
        client = named.get(tenant)
        if client is not None:
            named.move_to_end(tenant)
            return client
        client = named[tenant] = self.default.for_tenant(tenant, self.buffer_bytes)
        if self.default.available:
            client.ready.wait(self.default.timeout_s)
        if len(named) > self.max_open:
            _, old = named.popitem(last=False)
            for name, n in old.counts.items():
                self._closed_counts[name] += n
            threading.Thread(target=old.close, args=(True,), name="kvtier-store-retire", daemon=True).start()
        return client

    def stats(self) -> dict:
        """The default client's ``stats`` with every tenant's counts added (open or closed)."""
        out = self.default.stats()
        named = list(self._named.values())
        for name, n in self._closed_counts.items():
            out[name] += n + sum(client.counts[name] for client in named)
        out["queue_depth"] += sum(client.queue_depth for client in named)
        out["tenant_clients"] = len(named)
        return out

    def close(self) -> None:
        for client in (self.default, *self._named.values()):
            client.close()


def _local_hostname(master: str) -> str:
    """The address this process offers the store's transfer engine: 127.0.0.1 beside a local
    master, else this host's name (``KVTIER_STORE_HOSTNAME`` overrides); the engine adds a port of
    its own unless it names one (``store_engine.engine_name``)."""
    explicit = os.environ.get("KVTIER_STORE_HOSTNAME")
    if explicit:
        return explicit
    host = master.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    import socket

    return socket.gethostname()
