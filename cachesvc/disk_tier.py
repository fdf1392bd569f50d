"""The disk tier: KV blocks as checked record files in one directory, written behind the caller.

A ``kvtier.cachesvc.tiers.Tier`` of medium ``disk``. Blocks arrive with ``submit_store``
(``offer`` per block: evicted from the host cache, or written through) and go onto a bounded
write-behind queue that one writer thread drains; when the queue is full the block is skipped and
counted (``TierCounts.skipped``: GetStats, ``kvtier_cache_tier_skipped_blocks_total``), so an RPC
never waits for a disk. A queued block answers ``lookup`` with NOT_YET. Each block is one file
(``cachesvc.disk_records``), written atomically and in groups: the writer takes everything
queued (up to ``group_blocks``), writes each record to a temporary file in the same directory,
makes them durable with one ``syncfs`` of the directory's filesystem (an fsync per file where
there is no syncfs), renames each to its block's name, then fsyncs the directory once. A record
appears under its name only after its bytes are durable, so a kill at any instant leaves whole,
checksummed records and temporary files, which the next start deletes by their names; one fsync
per record capped the writer near 200 records/s and a burst of evictions skipped most writes
(issue 31; bench/tiers.py measures both ways). One file per record rather than append-only
segments because the tier evicts single blocks in LRU order: an eviction is one unlink, with no
segment compaction.

Passing down: once a store asks for it (``submit_store(..., pass_down=True)``: the shared tier
below, under ``--shared-tier-policy evict``), the writer reads each record it evicts back (checked
in full; a bad one is only dropped) before the unlink, and the next such store returns them with
their tenants (a record carries its block's: one written before a restart goes down as its too).

Opening a directory rebuilds the index from the records themselves (``cachesvc.disk_scan``:
length, header, this pool's layout and the key matching the file name for every record, the
checksum too for those read in the first ``verify_s`` seconds, so the open takes bounded time);
what fails is deleted with a log line naming the file and the reason, so a torn write, a flipped
byte or another model's block is never indexed. Recency order at restart is the files' mtime (a
hit sets it). Every read checks the record in full, checksum included, before returning its
bytes. A directory that cannot be used at startup is an error naming it (``DiskPathError``, or
``UntrustedPath`` for one another user owns or others can write, the run directory's rule); an
I/O error later disables the tier with a warning: it then holds nothing, serves nothing and
accepts nothing. ``queue_depth`` counts the group being written: 0 means every block taken is indexed.

Threads: ``offer``, ``lookup_chain``, ``load`` and ``stats`` are called from the service's loop;
the writer thread owns writes and evictions. ``lock`` guards the index (held briefly: never
across a read or an fsync).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np

from kvtier.cachesvc.disk_files import check_writable, copy_bytes, open_dir, write_records
from kvtier.cachesvc.disk_records import (
    KEY_PREFIX_BYTES,
    BadRecord,
    RecordLayout,
    check_key,
    decode,
    encode,
    file_name,
    record_bytes,
    tenant_field,
)
from kvtier.cachesvc.disk_scan import read_file, scan
from kvtier.cachesvc.events import EventRecord, tier_kind
from kvtier.cachesvc.tiers import Blocks, Job, JobResult, Lookup, Tier, TierCounts
from kvtier.media import medium

log = logging.getLogger("kvtier.cache")

GROUP_BLOCKS = 256  # most records one group write makes durable together (--disk-write-queue's default)
_KINDS = (tier_kind(False, "disk"), tier_kind(True, "disk"))


class DiskTier(Tier):
    """Block records under ``path``, at most ``budget_bytes`` of record files, LRU.

    ``layout`` is what every record must match to be served (this pool's model fingerprint,
    block size, dtype and block shape); ``queue_blocks`` bounds the write-behind queue (blocks);
    ``group_blocks`` is the most records one group write makes durable together (1: an fsync
    per record, the writer before issue 31, kept as bench/tiers.py's baseline); ``verify_s`` is
    how long the startup scan checksums records before it checks heads only. Keys are
    prefix-index keys (``kvtier.block_hash``: ``parent-or-extra || token bytes``).
    """

    medium = medium("disk")

    def __init__(
        self,
        path: str | Path,
        budget_bytes: int,
        layout: RecordLayout,
        *,
        queue_blocks: int = 256,
        group_blocks: int = GROUP_BLOCKS,
        verify_s: float = 30.0,
    ) -> None:
        self.path = Path(path)
        self.layout = layout
        self.record_size = record_bytes(layout, 32 + 4 * layout.block_size)
        if budget_bytes < self.record_size:
            raise ValueError(
                f"--disk-gib budget of {budget_bytes} bytes is below one record ({self.record_size} bytes)"
            )
        if queue_blocks <= 0 or group_blocks <= 0:
            raise ValueError(f"write queue of {queue_blocks} and groups of {group_blocks} blocks must be > 0")
        self.block_bytes = layout.block_bytes
        self.budget_bytes = budget_bytes
        self.queue_blocks = queue_blocks
        self.group_blocks = group_blocks
        self.lock = threading.RLock()
        self.enabled = True
        # The tier's KV-event records (a record entering or leaving the index), appended on the
        # writer thread or the caller's (deque appends are atomic); taken by take_events.
        self._events: deque[EventRecord] = deque()
        self._loaded: list[JobResult] = []
        # key -> record file size in bytes, least recently used first.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "promotions", "writes", "write_groups", "skipped_writes", "evictions")
            + ("dropped_at_startup", "dropped_on_read", "passed_down"),
            0,
        )
        self._queue: deque[tuple[bytes, bytes | None, np.ndarray, str]] = deque()
        self._pending: set[bytes] = set()  # keys queued or being written (NOT_YET), under _queue_cond
        self._queue_cond = threading.Condition()
        self._writing = 0
        self._closed = False
        # Evicted blocks read back for the tier below (key, tenant, payload; at most queue_blocks).
        self._pass_down = False
        self._out: deque[tuple[bytes, str, memoryview]] = deque()
        self._lock_fd = open_dir(self.path)
        try:
            self._scan(verify_s)
            self._evict_to(self.budget_bytes)
            check_writable(self.path, self.record_size, self._bytes, self.budget_bytes)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._changed(True, list(self._index))  # records found at startup: a consumer learns what disk holds
        self._writer = threading.Thread(
            target=self._write_loop, name=f"disk-tier-writer {self.path}", daemon=True
        )
        self._writer.start()

    # ------------------------------------------------------------------ startup

    def _scan(self, verify_s: float) -> None:
        """Index the directory's good records (``cachesvc.disk_scan``), least recently used first."""
        result = scan(self.path, self.layout, verify_s)
        self._index.update(result.records)
        self._bytes = sum(size for _, size in result.records)
        self._counts["dropped_at_startup"] = result.dropped
        log.info(
            "disk tier %s: %d records (%.1f MiB; %d checksummed, the rest when first read) indexed in "
            "%.2f s, %d dropped; budget %.1f MiB", self.path, len(self._index), self._bytes / 2**20,
            result.verified, result.seconds, result.dropped, self.budget_bytes / 2**20,
        )  # fmt: skip

    # ------------------------------------------------------------------ the service's side

    def offer(self, key: bytes, parent_hash: bytes | None, payload, tenant: str = "") -> bool:
        """Queue one ``tenant``'s block for writing; False (counted as skipped) if the queue is full or the tier off.

        ``payload`` is the block's bytes (any bytes-like object or a CPU tensor); it is copied
        here, so the caller may reuse its memory when this returns. Never blocks on the disk.
        ValueError for a key, payload or tenant that does not fit this tier's layout.
        """
        tenant_field(tenant)
        check_key(self.layout, key, parent_hash)
        with self._queue_cond:
            taken = self._taken(key)
        if taken is not None:
            return taken
        data = copy_bytes(payload)  # outside the lock and the GIL: the writer keeps writing meanwhile
        if len(data) != self.layout.block_bytes:
            raise ValueError(
                f"payload of {len(data)} bytes; a block of this tier is {self.layout.block_bytes}"
            )
        with self._queue_cond:
            taken = self._taken(key)  # again: the key may have been queued, or the queue filled, meanwhile
            if taken is None:
                self._queue.append((key, parent_hash, data, tenant))
                self._pending.add(key)
                self._queue_cond.notify()
        return taken is None or taken

    def _taken(self, key: bytes) -> bool | None:
        """Under ``_queue_cond``: True if ``key`` is queued or written already, False (counted as
        skipped) if the queue is full or the tier off, None if it is to be queued."""
        if key in self._pending or (self.enabled and key in self._index):
            return True
        if not self.enabled or self._closed or len(self._queue) >= self.queue_blocks:
            self._counts["skipped_writes"] += 1
            return False
        return None

    # ------------------------------------------------------------------ the Tier

    def lookup(self, key: bytes) -> Lookup:
        if self.enabled and key in self._index:
            return Lookup.HIT
        return Lookup.NOT_YET if key in self._pending else Lookup.MISS

    def held(self):
        """The index (its keys are the records written; cleared, not replaced, when the tier goes off)."""
        return self._index

    def submit_store(self, blocks: Blocks, pass_down: bool = False) -> Blocks | None:
        """Queue ``blocks`` (``offer`` each, parent hash = the key's first 32 bytes, with its
        tenant). Evictions happen on the writer thread: with ``pass_down``, the blocks evicted
        since the last such call (read back; from then on), else None."""
        rows = blocks.rows
        if rows.is_cuda:  # a cuda pool's rows, written through: one copy to host memory
            rows = rows[list(blocks.row_ids)].cpu()
            ids = range(len(blocks.keys))
        else:
            ids = blocks.row_ids
        self._pass_down |= pass_down  # before the offers: the writer may evict for them at once
        tenants = blocks.tenants or [""] * len(blocks.keys)
        for key, i, tenant in zip(blocks.keys, ids, tenants, strict=True):
            self.offer(key, key[:KEY_PREFIX_BYTES], rows[i], tenant)
        if not pass_down:
            return None
        out = [self._out.popleft() for _ in range(len(self._out))]  # the writer may append meanwhile
        if not out:
            return None
        import torch

        data = torch.from_numpy(np.stack([np.frombuffer(payload, np.uint8) for _, _, payload in out]))
        return Blocks([k for k, _, _ in out], data, range(len(out)), [t for _, t, _ in out])

    def submit_load(self, job: Job) -> None:
        """Read, check and copy the job's leading recorded keys into its rows (``load_into``); a
        record failing its checks ends the run. Complete when this returns."""
        rows, n = job.blocks.rows, 0
        for key, i in zip(job.blocks.keys, job.blocks.row_ids, strict=True):
            if not self.load_into(key, rows[i]):
                break
            n += 1
        self._counts["promotions"] += n
        self._loaded.append(JobResult(job.job_id, n))

    def finished_jobs(self, timeout_s: float = 0.0) -> list[JobResult]:
        done, self._loaded = self._loaded, []
        return done

    def discard(self, key: bytes) -> bool:
        held = key in self._index
        self._forget(key, unlink=True)
        return held

    def take_events(self) -> list[EventRecord]:
        events = self._events  # the writer may append meanwhile
        return [events.popleft() for _ in range(len(events))]

    def counts(self) -> TierCounts:
        st = self.stats()
        return TierCounts(
            blocks=st["blocks"], bytes=st["bytes"], hits=st["hits"], promotions=st["promotions"],
            evictions=st["evictions"], stored=st["writes"], skipped=st["skipped_writes"],
            queue_depth=st["queue_depth"], extra=st,
        )  # fmt: skip

    def contains(self, key: bytes) -> bool:
        return self.enabled and key in self._index

    def load(self, key: bytes) -> memoryview | None:
        """The verified payload of ``key``'s record (``layout.block_bytes`` bytes), or None.

        A record that fails its checks is deleted with a warning and never returned; a read error
        disables the tier. A hit becomes the most recently used record.
        """
        with self.lock:
            if not self.enabled or key not in self._index:
                self._counts["misses"] += 1
                return None
            self._index.move_to_end(key)
        name = file_name(key)
        try:
            data, _ = read_file(self.path / name, self.layout)  # a size no record has: not read
            _, payload = decode(self.layout, data, name, key)
        except FileNotFoundError:  # evicted by the writer since the index said yes
            self._forget(key, unlink=False)
            return None
        except BadRecord as e:
            log.warning("disk tier %s: dropped %s on read: %s", self.path, name, e)
            self._counts["dropped_on_read"] += 1
            self._forget(key, unlink=True)
            return None
        except OSError as e:
            self._disable(f"reading {name}: {e}")
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path / name)  # recency survives a restart
        self._counts["hits"] += 1
        return payload

    def load_into(self, key: bytes, dst_view) -> bool:
        """``load`` into one pool block ``dst_view`` (a contiguous tensor of ``block_bytes``); False on a miss."""
        import torch

        from kvtier.cachesvc.host_area import copy_block

        payload = self.load(key)
        if payload is None:
            return False
        flat = dst_view.reshape(-1).view(torch.uint8)
        if flat.numel() != self.layout.block_bytes:
            raise ValueError(
                f"destination of {flat.numel()} bytes; a block of this tier is {self.layout.block_bytes}"
            )
        copy_block(flat, payload)
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued block is written (or dropped); False if ``timeout_s`` ran out."""
        with self._queue_cond:
            return self._queue_cond.wait_for(lambda: not self._queue and not self._writing, timeout_s)

    def stats(self) -> dict:
        """Counters (blocks, bytes, hits, writes, skipped writes, queue depth, drops); a snapshot."""
        with self._queue_cond:  # first: a group leaves ``_writing`` after it enters the index
            depth = len(self._queue) + self._writing
        with self.lock:
            out = {"blocks": len(self._index), "bytes": self._bytes, **self._counts}
        out.update(budget_bytes=self.budget_bytes, queue_depth=depth, queue_blocks=self.queue_blocks)
        out["enabled"] = self.enabled
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (up to ``timeout_s``), stop the writer and release the directory."""
        self.flush(timeout_s)
        with self._queue_cond:
            self._closed = True
            self._queue_cond.notify_all()
        self._writer.join(timeout_s)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ------------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        cond = self._queue_cond
        while True:
            with cond:
                cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                group = [self._queue.popleft() for _ in range(min(len(self._queue), self.group_blocks))]
                self._writing = len(group)
            try:
                if self.enabled:
                    self._write_group(group)
            except Exception as e:  # noqa: BLE001 - the writer must not die silently: the tier goes off
                self._disable(f"writing {len(group)} records from {file_name(group[0][0])}: {e}")
            finally:
                with cond:
                    self._writing = 0
                    self._pending.difference_update(entry[0] for entry in group)
                    cond.notify_all()

    def _write_group(self, group: list[tuple[bytes, bytes | None, np.ndarray, str]]) -> None:
        """Records of ``group`` (those not written yet), made durable together
        (``disk_files.write_records``) after LRU records make room for them; then they enter the index."""
        records = [
            (key, encode(self.layout, key, parent, payload, tenant))
            for key, parent, payload, tenant in group
            if key not in self._index
        ]
        if not records:
            return
        sizes = [sum(memoryview(b).nbytes for b in buffers) for _, buffers in records]
        self._evict_to(self.budget_bytes - sum(sizes))
        write_records(
            self.path,
            self._lock_fd,
            records,
            per_file=self.group_blocks == 1,
            sync_dir=self.group_blocks > 1 or not self._queue,
        )
        with self.lock:
            if not self.enabled:
                return
            for (key, _), size in zip(records, sizes, strict=True):
                self._index[key] = size
                self._bytes += size
            self._counts["writes"] += len(records)
            self._counts["write_groups"] += 1
        self._changed(True, [key for key, _ in records])
        self._evict_to(self.budget_bytes)  # a group larger than the budget: its oldest records go too

    def _evict_to(self, limit: int) -> None:
        """Delete least recently used records until the index holds at most ``limit`` bytes (each
        read back first for the tier below, once a store asked to pass down: ``_read_back``)."""
        while True:
            with self.lock:
                if self._bytes <= limit or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._bytes -= size
                self._counts["evictions"] += 1
            self._changed(False, [key])
            if self._pass_down and len(self._out) < self.queue_blocks:
                self._read_back(key)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path / file_name(key))

    def _read_back(self, key: bytes) -> None:
        """Queue evicted ``key``'s block (key, tenant, payload) for the tier below, if its record
        passes every check (a bad or vanished one is only dropped)."""
        name = file_name(key)
        try:
            data, _ = read_file(self.path / name, self.layout)
            _, payload, tenant = decode(self.layout, data, name, key, with_tenant=True)
        except (BadRecord, OSError) as e:
            log.warning("disk tier %s: evicted %s not passed down: %s", self.path, name, e)
            return
        self._out.append((key, tenant, payload))
        self._counts["passed_down"] += 1

    def _forget(self, key: bytes, *, unlink: bool) -> None:
        with self.lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        if size is not None:
            self._changed(False, [key])
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path / file_name(key))

    def _disable(self, why: str) -> None:
        """Turn the tier off after an I/O error: nothing is served or written from now on."""
        if self.enabled:
            log.warning("disk tier %s disabled: %s", self.path, why)
        with self._queue_cond:
            self.enabled = False
            self._queue.clear()
        with self.lock:
            dropped = list(self._index)
            self._index.clear()
            self._bytes = 0
        self._changed(False, dropped)

    def _changed(self, stored: bool, keys: list[bytes]) -> None:
        """One event record of ``keys`` entering (``stored``) or leaving the index (no block ids)."""
        if keys:
            self._events.append((_KINDS[stored], tuple(keys), (-1,) * len(keys)))
