"""The shared tier: published blocks in Mooncake Store, so a prefix computed on any node hits on every node.

A ``Tier`` (``cachesvc.tiers``) of medium ``shared`` (``kvtier.media``: ranked below the disk,
priced below the host cache and above recompute). It holds nothing itself: its blocks are
objects in the store, reached through ``cachesvc.store_client.StoreClient``, whose every call is
bounded and whose circuit breaker turns a store that is down, slow or full into misses (the node
serves from its own tiers and recomputes; one WARNING; it comes back on its own).

One block is one object:

- **its name** is the block's full identity: ``kvtier/<model fingerprint, 16 hex>/<digest>``
  where the digest is SHA-256 over the pool's layout (model fingerprint, block size, dtype,
  block shape, block bytes: ``disk_records.RecordLayout``) and the block's prefix-index key
  (``parent-or-extra || token ids``; the chain's root mixes in the model, the tenant's salt and
  the adapter: ``kvtier.block_hash``). Two tenants' blocks, or two models', never share a name.
- **its bytes** are a disk record (``cachesvc.disk_records``: magic and version, msgpack header
  with the layout, the parent hash and the key, the payload, a blake3 checksum). A load
  checks all of it (``disk_records.decode``) before one byte reaches the pool: a damaged object,
  or another model's object under a colliding name, is a miss, counted as ``bad_objects``.

Writes (``--shared-tier-policy``): ``through`` (the default) stores each block as it is
published on this node (``write_published``: the node hands over the block manager's STORED
records after each call), so a prefix computed on one node is a hit on every node from then on;
``evict`` stores only what the node's own lowest tier evicts (the stack's loop down), so the store
holds what this node no longer does (with ``--offload-min-hits N``: only blocks hit N times). Either
way the bytes are copied out of the pool row before the call returns; the object is checksummed
and put by the store client's writer thread. The store evicts on its own (its master's
watermark); this tier evicts nothing.

Tenants: a block is stored, looked up and loaded by its tenant's client (``Blocks.tenants``,
``Job.tenant``, ``held_for``; ``store_client.TenantClients``), so under the master's strict
multi-tenant mode a tenant's blocks count against its quota and no tenant sees another's objects.
A block of unknown tenant is the default's (host and disk pass their blocks' tenants down).

What this node knows the store holds (``_known``, at most KNOWN_KEYS, oldest forgotten first) is
what its KV events say: a key leaves it with a REMOVED event (medium ``shared``) when forgotten,
when a load or lookup finds the store lost it, when its put failed, and all keys when the store
comes back from an outage. So the router's view of the shared tier stays bounded.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Container, Sequence
from functools import partial
from typing import TYPE_CHECKING

from kvtier.cachesvc.disk_records import (
    CHECKSUM_BYTES,
    KEY_PREFIX_BYTES,
    BadRecord,
    RecordLayout,
    record_bytes,
)
from kvtier.cachesvc.events import STORED, tier_kind
from kvtier.cachesvc.store_client import StoreAddress, StoreClient, TenantClients
from kvtier.cachesvc.store_objects import (
    check_parts,
    copy_into,
    decode_object,
    encode_object,
    object_name,
    row_bytes,
)
from kvtier.cachesvc.tiers import Blocks, Job, JobResult, Lookup, Tier, TierCounts
from kvtier.media import medium

if TYPE_CHECKING:
    from kvtier.cachesvc.events import EventRecord

log = logging.getLogger("kvtier.cache")

POLICIES = ("evict", "through")
BATCH_BYTES = 8 << 20  # bytes of objects one get asks for
REGISTER_BYTES = 16 << 20  # load destinations this large (the pool) are registered with the transfer engine
KNOWN_KEYS = 65536  # keys this node knows the store held when last asked (the cheap ``held`` view)
NOT_WRITTEN = (
    "dropped_writes",
    "failed_writes",
    "quota_refused",
    "unregistered_tenant",
)  # store counts: skipped
MAX_TENANTS = 8  # named tenants' store clients open at once (each holds a transfer buffer)


class SharedTier(Tier):
    """Blocks of this pool's ``layout`` in Mooncake Store through ``client`` (module docstring)."""

    medium = medium("shared")

    def __init__(
        self, client: StoreClient, layout: RecordLayout, *, policy="through", max_tenants=MAX_TENANTS,
        known_keys=KNOWN_KEYS,
    ) -> None:  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"--shared-tier-policy {policy!r} is not one of {POLICIES}")
        self.client = client  # the default tenant's
        self.clients = TenantClients(client, max_tenants, 2 * BATCH_BYTES)
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.record_size = record_bytes(layout, KEY_PREFIX_BYTES + 4 * layout.block_size)
        self.write_through = policy == "through"
        # Keys the store held when this node last asked or wrote them, most recent last, and their
        # tenant: the cheap ``held`` view (a hint: a load still checks the store and the object).
        self._known: OrderedDict[bytes, str] = OrderedDict()
        self.known_keys = known_keys  # its bound
        self._epoch = client.breaker.epoch  # the store's objects may be gone after it was down
        self._view = _StoreView(self, "")
        self._scratch_rows = None  # _scratch's buffer
        self._pending: set[bytes] = set()  # queued for the store, not yet written (lookup: NOT_YET)
        self._results: list[JobResult] = []
        self._events: deque = deque()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("hits", "promotions", "stored", "skipped", "bad_objects", "misses"), 0)

    # -- lookups ----------------------------------------------------------------------------------

    def lookup(self, key: bytes, tenant: str = "") -> Lookup:
        if key in self._pending:
            return Lookup.NOT_YET
        found = self.clients.of(tenant).exists([object_name(self.layout, key)])
        if not found or not found[0]:
            if found is not None:  # the store answered: it lacks the object
                self._forget(key, tenant)
            return Lookup.MISS
        self._remember([key], tenant)
        return Lookup.HIT

    def lookup_chain(self, keys: Sequence[bytes], tenant: str = "") -> int:
        """How many leading ``keys`` the store holds for ``tenant``: one bounded batch call (0 if down)."""
        if not keys:
            return 0
        found = self.clients.of(tenant).exists([object_name(self.layout, k) for k in keys])
        if found is None:
            return 0
        n = found.index(False) if False in found else len(found)
        self._remember(keys[:n], tenant)
        if n < len(keys):
            self._forget(keys[n], tenant)
        return n

    def held(self) -> Container[bytes]:
        """Keys the store holds, asked as the stack walks a chain: those this node knows it held
        (it wrote them, or a lookup found them), else one bounded question to the store per key (a
        miss ends the walk; the breaker open: none). As the default tenant; ``held_for`` as another."""
        return self._view

    def held_now(self) -> list[bytes]:  # what this node knows the store holds: held() would ask it
        with self._lock:
            return list(self._known)

    def held_for(self, tenant: str) -> Container[bytes]:
        return _StoreView(self, tenant) if tenant else self._view

    def _known_now(self) -> OrderedDict[bytes, str]:
        if self._epoch != self.client.breaker.epoch:  # the store was down: it may have restarted empty
            self._epoch = self.client.breaker.epoch
            with self._lock:
                self._announce(False, tuple(self._known))
                self._known.clear()
        return self._known

    def _remember(self, keys: Sequence[bytes], tenant: str | Sequence[str] = "") -> None:
        """Keys the store holds, of ``tenant`` (one for all, or one per key)."""
        known = self._known_now()
        dropped = []
        with self._lock:
            for i, key in enumerate(keys):
                known[key] = tenant if isinstance(tenant, str) else tenant[i]
                known.move_to_end(key)
            while len(known) > self.known_keys:
                dropped.append(known.popitem(last=False)[0])
            self._announce(False, dropped)

    def _announce(self, stored: bool, keys: Sequence[bytes]) -> None:
        """One event record: ``keys`` written to the store (``stored``), or no longer said held."""
        if keys:
            self._events.append((tier_kind(stored, self.medium.name), tuple(keys), (-1,) * len(keys)))

    # -- stores -----------------------------------------------------------------------------------

    def submit_store(self, blocks: Blocks, pass_down: bool = False) -> Blocks | None:
        """Queue the blocks as objects (their bytes copied now); a block the client cannot take
        (the store down, the queue full) is skipped and counted. Evicts nothing (the store
        evicts on its own), so nothing is passed down."""
        rows = blocks.rows
        stored: list[bytes] = []
        tenants: list[str] = []
        known = self._known_now()
        for i, (key, row_id) in enumerate(zip(blocks.keys, blocks.row_ids, strict=True)):
            if key in known:
                continue  # the store has it (another node's, or ours): no second write
            tenant = blocks.tenants[i] if blocks.tenants else ""
            payload = bytes(row_bytes(rows[row_id]))  # the one copy on the caller's thread
            self._pending.add(key)
            encoded = partial(encode_object, self.layout, key, payload)
            if self.clients.of(tenant).put(
                object_name(self.layout, key), encoded, partial(self._written, key)
            ):
                stored.append(key)
                tenants.append(tenant)
            else:
                self._pending.discard(key)
                self._counts["skipped"] += 1
        if stored:
            self._counts["stored"] += len(stored)
            self._remember(stored, tenants)
            self._announce(True, stored)
        return None

    def _written(self, key: bytes, ok: bool) -> None:
        """The store writer's word on ``key`` (its thread): no longer pending; forgotten if it failed."""
        self._pending.discard(key)
        if not ok:
            self._forget(key)

    def write_published(self, records: Sequence[EventRecord], pool_rows, block_tenants=None) -> None:
        """``through``: store the blocks the device's STORED ``records`` published (the block
        manager's event records of one call; ``cachesvc.events``), from ``pool_rows``, each as the
        tenant ``block_tenants[block id]`` names (``BlockManager.block_tenants``; None: the default)."""
        keys: list[bytes] = []
        block_ids: list[int] = []
        for record in records:
            if record[0] != STORED:
                continue
            _, hashes, ids, token_bytes, parent, extra = record
            step = len(token_bytes) // len(ids)
            for i, block_id in enumerate(ids):
                keys.append(
                    (hashes[i - 1] if i else parent or extra) + token_bytes[i * step : (i + 1) * step]
                )
                block_ids.append(block_id)
        if keys:
            tenants = [block_tenants[i] for i in block_ids] if block_tenants else ()
            self.submit_store(Blocks(keys, pool_rows, block_ids, tenants))

    # -- loads ------------------------------------------------------------------------------------

    def submit_load(self, job: Job) -> None:
        """Fetch the job's keys in bounded batches (each fits the client's transfer buffer) and
        land the leading run that passes every check in its rows; ``finished_jobs`` says how many.
        Host rows take each payload in place (the object scattered into a header buffer, the row
        and a checksum buffer, then checked there: a row that fails is the block to recompute);
        device rows through host bytes."""
        blocks, client = job.blocks, self.clients.of(job.tenant)
        names = [object_name(self.layout, k) for k in blocks.keys]
        direct = not blocks.rows.is_cuda and blocks.rows.is_contiguous()
        load = self._load_in_place if direct else self._load_copied
        n = load(blocks, names, client)
        self._counts["hits"] += n
        self._counts["promotions"] += n
        self._results.append(JobResult(job.job_id, n))

    def _load_in_place(self, blocks: Blocks, names: list[str], client: StoreClient) -> int:
        """NOTE: a whole batch lands at once, so a row past the run it reports may have been
        written (an object after one that failed its checks): those are the blocks the caller
        computes. Keys this node does not know the store holds are asked first, so a plain miss
        ends the batch before anything lands."""
        known = self._known_now()
        unknown = [i for i, k in enumerate(blocks.keys) if k not in known]
        if unknown:
            found = client.exists([names[i] for i in unknown])
            missing = [i for i, f in zip(unknown, found or [False] * len(unknown), strict=True) if not f]
            if missing:
                names = names[: missing[0]]
                if found is not None:  # the store answered: it lacks the object
                    self._forget(blocks.keys[missing[0]], client.tenant)
        rows, head = blocks.rows, self.record_size - self.block_bytes - CHECKSUM_BYTES
        if rows.numel() >= REGISTER_BYTES:  # the pool: registered once, transfers land in place
            client.register(rows.data_ptr(), rows.numel())
        n, per_call = 0, self._per_call
        scratch = self._scratch(head, client)
        for start in range(0, len(names), per_call):
            chunk = names[start : start + per_call]
            ptrs = [
                [scratch[i].ctypes.data, rows[r].data_ptr(), scratch[i].ctypes.data + head]
                for i, r in enumerate(blocks.row_ids[start : start + len(chunk)])
            ]
            sizes = [[head, self.block_bytes, CHECKSUM_BYTES]] * len(chunk)
            for i, size in enumerate(client.get_into(chunk, ptrs, sizes) or ()):
                parts = (scratch[i], head, rows[blocks.row_ids[n]])
                if not self._accept(client.tenant, blocks.keys[n], names[n], size, check_parts, *parts):
                    return n
                n += 1
            if n < start + len(chunk):
                return n
        return n

    def _load_copied(self, blocks: Blocks, names: list[str], client: StoreClient) -> int:
        n = 0
        for key, row_id, data in zip(blocks.keys, blocks.row_ids, self._fetch(names, client), strict=False):
            if not self._accept(client.tenant, key, names[n], len(data), decode_object, data):
                break
            copy_into(blocks.rows[row_id], decode_object(self.layout, key, data))
            n += 1
        return n

    def _accept(self, tenant: str, key: bytes, name: str, size: int, check, *args) -> bool:
        """Whether the object fetched for ``key`` as ``tenant`` (``size`` bytes, <= 0: missing)
        passes ``check(layout, key, *args)`` (BadRecord if not)."""
        if size <= 0:
            self._forget(key, tenant)
            self._counts["misses"] += 1
            return False
        try:
            check(self.layout, key, *args)
        except BadRecord as e:
            self._counts["bad_objects"] += 1
            self._forget(key, tenant)
            log.warning("shared tier: object %s refused (%s); recomputing it", name, e)
            return False
        return True

    @property
    def _per_call(self) -> int:
        """Objects per get: BATCH_BYTES of them (each call well inside --shared-tier-timeout-s on a
        loaded host; get_batch's bytes also fit the client's transfer buffer)."""
        return max(1, min(BATCH_BYTES, self.client.buffer_bytes // 2) // self.record_size)

    def _scratch(self, head: int, client: StoreClient):
        """Per object of one batch: its header and checksum bytes (numpy, registered once with the
        transfer engine every tenant's client shares)."""
        if self._scratch_rows is None:
            import numpy as np

            self._scratch_rows = np.zeros((self._per_call, head + CHECKSUM_BYTES), np.uint8)
        client.register(self._scratch_rows.ctypes.data, self._scratch_rows.nbytes)
        return self._scratch_rows

    def _fetch(self, names: list[str], client: StoreClient):
        """The objects under ``names`` in order, batch by batch, until one is missing or a call fails."""
        per_call = self._per_call
        for start in range(0, len(names), per_call):
            objects = client.get(names[start : start + per_call])
            if not objects:
                return
            yield from objects
            if not all(objects):
                return

    def finished_jobs(self, timeout_s: float = 0.0) -> list[JobResult]:
        results, self._results = self._results, []
        return results

    def discard(self, key: bytes, tenant: str | None = None) -> bool:
        """Remove ``key``'s object from the store (for every node: the tier is one; as ``tenant``,
        else as the tenant it was known under), a REMOVED event; False if the store did not hold
        it (or did not answer in time)."""
        client = self.clients.of(self._known.get(key, "") if tenant is None else tenant)
        self._forget(key)
        removed = client.remove([object_name(self.layout, key)])
        return bool(removed and removed[0])

    def _forget(self, key: bytes, tenant: str | None = None) -> bool:
        """The store lacks ``key`` (or its object is bad) as ``tenant`` (None: any): forgotten, and
        a REMOVED event even if this node never knew it (the router may have it from another
        node's events). At most one per walk (the first miss); a key known as another tenant stays."""
        with self._lock:
            known_as = self._known.get(key)
            if known_as is not None and tenant not in (None, known_as):
                return False
            if known_as is not None:
                del self._known[key]
            self._announce(False, (key,))
            return known_as is not None

    def take_events(self) -> list[EventRecord]:
        events = self._events
        return [events.popleft() for _ in range(len(events))]

    def counts(self) -> TierCounts:
        c = self._counts
        store = self.clients.stats()
        return TierCounts(
            blocks=len(self._known),
            bytes=len(self._known) * self.block_bytes,
            hits=c["hits"],
            promotions=c["promotions"],
            stored=store["writes"],
            skipped=c["skipped"] + sum(store[k] for k in NOT_WRITTEN),
            queue_depth=store["queue_depth"],
            extra={**store, "bad_objects": c["bad_objects"], "misses": c["misses"], "queued": c["stored"]},
        )

    def close(self) -> None:
        self.clients.close()


class _StoreView:
    """``SharedTier.held_for(tenant)``: ``key in view`` as ``held``'s docstring says."""

    __slots__ = ("tenant", "tier")

    def __init__(self, tier: SharedTier, tenant: str) -> None:
        self.tier, self.tenant = tier, tenant

    def __contains__(self, key: object) -> bool:
        tier, tenant = self.tier, self.tenant
        return tier._known_now().get(key) == tenant or (
            tier.clients.of(tenant).available and tier.lookup(key, tenant) is Lookup.HIT
        )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The shared tier's flags (off unless ``--shared-tier`` is given)."""
    ap.add_argument(
        "--shared-tier", default="", metavar="mooncake://MASTER:PORT",
        help="Mooncake Store's master (RPC port, 50051 by default): published blocks go there (when, "
        "--shared-tier-policy says) and are fetched from there on a miss, by any node; off when empty",
    )  # fmt: skip
    ap.add_argument(
        "--shared-tier-metadata", default="", metavar="URL",
        help="the store's metadata server (default: the master's built-in one, http://MASTER:8080/metadata)",
    )  # fmt: skip
    ap.add_argument(
        "--shared-tier-segment-gib", type=float, default=0.0,
        help="memory this node lends the store (GiB); 0: the store's memory is its store servers' "
        "(a node that dies then takes no object with it)",
    )  # fmt: skip
    ap.add_argument(
        "--shared-tier-timeout-s", type=float, default=0.5,
        help="the longest a request waits on the store (a lookup or a fetch); past it the fetch is a miss, "
        "the tier is off until a probe answers, and the prefix is recomputed: keep it below a prompt's prefill",
    )  # fmt: skip
    ap.add_argument(
        "--shared-tier-policy", choices=POLICIES, default="through",
        help="through: a block goes to the store as soon as it is published here (computed once, a hit on "
        "every node); evict: only when this node's own lowest tier evicts it (with --offload-min-hits N, "
        "only blocks hit N times)",
    )  # fmt: skip


def build(args: argparse.Namespace, pool_rows, layout: RecordLayout) -> SharedTier | None:
    """The shared tier ``--shared-tier`` asks for (connecting in the background), or None;
    ValueError naming a bad flag, StoreUnavailable without Mooncake's client."""
    if not args.shared_tier:
        return None
    if args.shared_tier_segment_gib < 0:
        raise ValueError(f"--shared-tier-segment-gib = {args.shared_tier_segment_gib} must be >= 0")
    client = StoreClient(
        StoreAddress.parse(args.shared_tier, args.shared_tier_metadata),
        segment_bytes=int(args.shared_tier_segment_gib * 2**30),
        timeout_s=args.shared_tier_timeout_s,
    )
    tier = SharedTier(client, layout, policy=args.shared_tier_policy)
    client.connect()
    return tier
