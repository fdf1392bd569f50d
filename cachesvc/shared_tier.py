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
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import threading
import warnings
from collections import OrderedDict, deque
from collections.abc import Container, Sequence
from functools import partial
from typing import TYPE_CHECKING

from kvtier.cachesvc.disk_records import (
    CHECKSUM_BYTES,
    KEY_PREFIX_BYTES,
    BadRecord,
    RecordLayout,
    checksum,
    decode,
    decode_head,
    encode,
    file_name,
    record_bytes,
)
from kvtier.cachesvc.events import STORED, tier_kind
from kvtier.cachesvc.store_client import StoreAddress, StoreClient
from kvtier.cachesvc.tiers import Blocks, Job, JobResult, Lookup, Tier, TierCounts
from kvtier.media import medium

if TYPE_CHECKING:
    from kvtier.cachesvc.events import EventRecord

log = logging.getLogger("kvtier.cache")

POLICIES = ("evict", "through")
BATCH_BYTES = 8 << 20  # bytes of objects one get asks for
REGISTER_BYTES = 16 << 20  # load destinations this large (the pool) are registered with the transfer engine
KNOWN_KEYS = 65536  # keys this node knows the store held when last asked (the cheap ``held`` view)
OBJECT_PREFIX = "kvtier"


def object_name(layout: RecordLayout, key: bytes) -> str:
    """The store's name for the block whose prefix-index key is ``key`` in a pool of ``layout``."""
    digest = hashlib.sha256()
    for part in (
        layout.model_fingerprint,
        str(layout.block_size),
        layout.dtype,
        ",".join(map(str, layout.shape)),
        str(layout.block_bytes),
    ):
        digest.update(part.encode() + b"\0")
    digest.update(key)
    return f"{OBJECT_PREFIX}/{layout.model_fingerprint[:16]}/{digest.hexdigest()}"


def encode_object(layout: RecordLayout, key: bytes, payload) -> list[bytes]:
    """The object's parts (head + meta, payload, checksum), the payload copied (the pool row may
    be overwritten once the caller returns)."""
    head, body, checksum = encode(layout, key, key[:KEY_PREFIX_BYTES], payload)
    return [head, bytes(body), checksum]


def check_parts(layout: RecordLayout, key: bytes, scratch, head: int, row) -> None:
    """The checks of ``decode_object`` on an object landed in parts: its ``head`` bytes of header
    and meta and its checksum in ``scratch`` (uint8, ``head + 32``), its payload in ``row``."""
    body = memoryview(scratch)[:head]
    digest = checksum(body)
    digest.update(memoryview(row.numpy()))
    if digest.digest() != bytes(scratch[head:]):
        raise BadRecord("checksum mismatch (the bytes changed after they were written)")
    if decode_head(layout, bytes(body), head + layout.block_bytes + CHECKSUM_BYTES, file_name(key)) != key:
        raise BadRecord("carries another block's key")


def decode_object(layout: RecordLayout, key: bytes, data: bytes) -> memoryview:
    """The payload of object ``data`` fetched for ``key``, after every check; BadRecord otherwise."""
    return decode(layout, data, file_name(key), key)[1]


class SharedTier(Tier):
    """Blocks of this pool's ``layout`` in Mooncake Store through ``client`` (module docstring)."""

    medium = medium("shared")

    def __init__(self, client: StoreClient, layout: RecordLayout, *, policy: str = "through") -> None:
        if policy not in POLICIES:
            raise ValueError(f"--shared-tier-policy {policy!r} is not one of {POLICIES}")
        self.client = client
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.record_size = record_bytes(layout, KEY_PREFIX_BYTES + 4 * layout.block_size)
        self.write_through = policy == "through"
        # Keys the store held when this node last asked or wrote them, most recent last: the
        # cheap ``held`` view (a hint: a load still checks the store and the object).
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._epoch = client.breaker.epoch  # the store's objects may be gone after it was down
        self._view = _StoreView(self)
        self._scratch_rows = None  # _scratch's buffer
        self._pending: set[bytes] = set()  # queued for the store, not yet written (lookup: NOT_YET)
        self._results: list[JobResult] = []
        self._events: deque = deque()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("hits", "promotions", "stored", "skipped", "bad_objects", "misses"), 0)

    # -- lookups ----------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> Lookup:
        if key in self._pending:
            return Lookup.NOT_YET
        found = self.client.exists([object_name(self.layout, key)])
        if not found or not found[0]:
            return Lookup.MISS
        self._remember([key])
        return Lookup.HIT

    def lookup_chain(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the store holds: one bounded batch call (0 when it is down)."""
        if not keys:
            return 0
        found = self.client.exists([object_name(self.layout, k) for k in keys])
        if found is None:
            return 0
        n = found.index(False) if False in found else len(found)
        self._remember(keys[:n])
        return n

    def held(self) -> Container[bytes]:
        """Keys the store holds, asked as the stack walks a chain: what this node knows it held
        (it wrote it, or a lookup found it), else one bounded question to the store per key (a
        miss ends the walk, so a prompt the store lacks costs one; the breaker open: none)."""
        return self._view

    def _known_now(self) -> OrderedDict[bytes, None]:
        if self._epoch != self.client.breaker.epoch:  # the store was down: it may have restarted empty
            self._epoch = self.client.breaker.epoch
            with self._lock:
                self._known.clear()
        return self._known

    def _remember(self, keys: Sequence[bytes]) -> None:
        known = self._known_now()
        with self._lock:
            for key in keys:
                known[key] = None
                known.move_to_end(key)
            while len(known) > KNOWN_KEYS:
                known.popitem(last=False)

    # -- stores -----------------------------------------------------------------------------------

    def submit_store(self, blocks: Blocks, pass_down: bool = False) -> Blocks | None:
        """Queue the blocks as objects (their bytes copied now); a block the client cannot take
        (the store down, the queue full) is skipped and counted. Evicts nothing (the store
        evicts on its own), so nothing is passed down."""
        rows = blocks.rows
        stored: list[bytes] = []
        known = self._known_now()
        for key, row_id in zip(blocks.keys, blocks.row_ids, strict=True):
            if key in known:
                continue  # the store has it (another node's, or ours): no second write
            payload = bytes(_row_bytes(rows[row_id]))  # the one copy on the caller's thread
            self._pending.add(key)
            encoded = partial(encode_object, self.layout, key, payload)
            if self.client.put(object_name(self.layout, key), encoded, partial(self._written, key)):
                stored.append(key)
            else:
                self._pending.discard(key)
                self._counts["skipped"] += 1
        if stored:
            self._counts["stored"] += len(stored)
            self._remember(stored)
            self._events.append((tier_kind(True, self.medium.name), tuple(stored), (-1,) * len(stored)))
        return None

    def _written(self, key: bytes, ok: bool) -> None:
        """The store writer's word on ``key`` (its thread): no longer pending; forgotten if it failed."""
        self._pending.discard(key)
        if not ok:
            self._forget(key)

    def write_published(self, records: Sequence[EventRecord], pool_rows) -> None:
        """``through``: store the blocks the device's STORED ``records`` published (the block
        manager's event records of one call; ``cachesvc.events``), from ``pool_rows``."""
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
            self.submit_store(Blocks(keys, pool_rows, block_ids))

    # -- loads ------------------------------------------------------------------------------------

    def submit_load(self, job: Job) -> None:
        """Fetch the job's keys in bounded batches (each fits the client's transfer buffer) and
        land the leading run that passes every check in its rows; ``finished_jobs`` says how many.
        Host rows take each payload in place (the object scattered into a header buffer, the row
        and a checksum buffer, then checked there: a row that fails is the block to recompute);
        device rows through host bytes."""
        blocks = job.blocks
        names = [object_name(self.layout, k) for k in blocks.keys]
        direct = not blocks.rows.is_cuda and blocks.rows.is_contiguous()
        n = self._load_in_place(blocks, names) if direct else self._load_copied(blocks, names)
        self._counts["hits"] += n
        self._counts["promotions"] += n
        self._results.append(JobResult(job.job_id, n))

    def _load_in_place(self, blocks: Blocks, names: list[str]) -> int:
        """NOTE: a whole batch lands at once, so a row past the run it reports may have been
        written (an object after one that failed its checks): those are the blocks the caller
        computes. Keys this node does not know the store holds are asked first, so a plain miss
        ends the batch before anything lands."""
        known = self._known_now()
        unknown = [i for i, k in enumerate(blocks.keys) if k not in known]
        if unknown:
            found = self.client.exists([names[i] for i in unknown]) or [False] * len(unknown)
            missing = [i for i, f in zip(unknown, found, strict=True) if not f]
            names = names[: missing[0]] if missing else names
        rows, head = blocks.rows, self.record_size - self.block_bytes - CHECKSUM_BYTES
        if rows.numel() >= REGISTER_BYTES:  # the pool: registered once, transfers land in place
            self.client.register(rows.data_ptr(), rows.numel())
        n, per_call = 0, self._per_call
        scratch = self._scratch(head)
        for start in range(0, len(names), per_call):
            chunk = names[start : start + per_call]
            ptrs = [
                [scratch[i].ctypes.data, rows[r].data_ptr(), scratch[i].ctypes.data + head]
                for i, r in enumerate(blocks.row_ids[start : start + len(chunk)])
            ]
            sizes = [[head, self.block_bytes, CHECKSUM_BYTES]] * len(chunk)
            for i, size in enumerate(self.client.get_into(chunk, ptrs, sizes) or ()):
                row = rows[blocks.row_ids[n]]
                if not self._accept(blocks.keys[n], names[n], size, check_parts, scratch[i], head, row):
                    return n
                n += 1
            if n < start + len(chunk):
                return n
        return n

    def _load_copied(self, blocks: Blocks, names: list[str]) -> int:
        n = 0
        for key, row_id, data in zip(blocks.keys, blocks.row_ids, self._fetch(names), strict=False):
            if not self._accept(key, names[n], len(data), decode_object, data):
                break
            _copy_into(blocks.rows[row_id], decode_object(self.layout, key, data))
            n += 1
        return n

    def _accept(self, key: bytes, name: str, size: int, check, *args) -> bool:
        """Whether the object fetched for ``key`` (``size`` bytes, <= 0: missing) passes
        ``check(layout, key, *args)`` (BadRecord if not)."""
        if size <= 0:
            self._forget(key)
            self._counts["misses"] += 1
            return False
        try:
            check(self.layout, key, *args)
        except BadRecord as e:
            self._counts["bad_objects"] += 1
            self._forget(key)
            log.warning("shared tier: object %s refused (%s); recomputing it", name, e)
            return False
        return True

    @property
    def _per_call(self) -> int:
        """Objects per get: BATCH_BYTES of them (each call well inside --shared-tier-timeout-s on a
        loaded host; get_batch's bytes also fit the client's transfer buffer)."""
        return max(1, min(BATCH_BYTES, self.client.buffer_bytes // 2) // self.record_size)

    def _scratch(self, head: int):
        """Per object of one batch: its header and checksum bytes (numpy, registered once)."""
        if self._scratch_rows is None:
            import numpy as np

            self._scratch_rows = np.zeros((self._per_call, head + CHECKSUM_BYTES), np.uint8)
            self.client.register(self._scratch_rows.ctypes.data, self._scratch_rows.nbytes)
        return self._scratch_rows

    def _fetch(self, names: list[str]):
        """The objects under ``names`` in order, batch by batch, until one is missing or a call fails."""
        per_call = self._per_call
        for start in range(0, len(names), per_call):
            objects = self.client.get(names[start : start + per_call])
            if not objects:
                return
            yield from objects
            if not all(objects):
                return

    def finished_jobs(self, timeout_s: float = 0.0) -> list[JobResult]:
        results, self._results = self._results, []
        return results

    def discard(self, key: bytes) -> bool:
        """Remove ``key``'s object from the store (for every node: the tier is one), a REMOVED
        event; False if the store did not hold it (or did not answer in time)."""
        self._forget(key)
        removed = self.client.remove([object_name(self.layout, key)])
        if not removed or not removed[0]:
            return False
        self._events.append((tier_kind(False, self.medium.name), (key,), (-1,)))
        return True

    def _forget(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._known:
                return False
            del self._known[key]
            return True

    def take_events(self) -> list[EventRecord]:
        events = self._events
        return [events.popleft() for _ in range(len(events))]

    def counts(self) -> TierCounts:
        c = self._counts
        store = self.client.stats()
        return TierCounts(
            blocks=len(self._known),
            bytes=len(self._known) * self.block_bytes,
            hits=c["hits"],
            promotions=c["promotions"],
            stored=store["writes"],
            skipped=c["skipped"] + store["dropped_writes"] + store["failed_writes"],
            queue_depth=store["queue_depth"],
            extra={**store, "bad_objects": c["bad_objects"], "misses": c["misses"], "queued": c["stored"]},
        )

    def close(self) -> None:
        self.client.close()


class _StoreView:
    """``SharedTier.held()``: ``key in view`` as its docstring says."""

    __slots__ = ("tier",)

    def __init__(self, tier: SharedTier) -> None:
        self.tier = tier

    def __contains__(self, key: object) -> bool:
        tier = self.tier
        return key in tier._known_now() or (tier.client.available and tier.lookup(key) is Lookup.HIT)


def _row_bytes(row) -> memoryview:
    """One row (``[block_bytes]`` uint8 tensor) as a memoryview (a device row copied to the host)."""
    return memoryview((row.cpu() if row.is_cuda else row).numpy())


def _copy_into(row, payload: memoryview) -> None:
    """Copy a checked payload into one row (a uint8 tensor, host or device)."""
    import numpy as np

    if not row.is_cuda:
        row.numpy()[:] = np.frombuffer(payload, np.uint8)
        return
    import torch

    with warnings.catch_warnings():  # the fetched object is read-only bytes; it is only read
        warnings.simplefilter("ignore", UserWarning)
        row.copy_(torch.frombuffer(payload, dtype=torch.uint8))


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
