"""The disk tier: KV blocks as checked record files in one directory, written behind the caller.

Blocks arrive with ``offer`` (evicted from the host cache, or written through) and go onto a
bounded write-behind queue that one writer thread drains; when the queue is full the block is
skipped and counted, so an RPC never waits for a disk. Each block is one file
(``cachesvc.disk_records``), written atomically: a temporary file in the same directory, fsync,
rename to the block's name; the directory is fsynced whenever the queue runs empty. One file per
record rather than append-only segments because the tier evicts single blocks in LRU order: an
eviction is one unlink, with no segment compaction, and a crash can leave at most a temporary
file per writer, recognised by its name and deleted at the next start.

Opening a directory rebuilds the index from the records themselves (``cachesvc.disk_scan``:
length, header, this pool's layout and the key matching the file name for every record, the
checksum too for those read in the first ``verify_s`` seconds, so the open takes bounded time);
what fails is deleted with a log line naming the file and the reason, so a torn write, a flipped
byte or another model's block is never indexed. Recency order at restart is the files' mtime (a
hit sets it). Every read checks the record in full, checksum included, before returning its
bytes. A directory that
cannot be used at startup is an error naming it (``DiskPathError``, or ``UntrustedPath`` for one
another user owns or others can write, the run directory's rule); an I/O error later disables
the tier with a warning: it then holds nothing, serves nothing and accepts nothing.

Threads: ``offer``, ``lookup_chain``, ``load`` and ``stats`` are called from the service's loop;
the writer thread owns writes and evictions. ``lock`` guards the index (held briefly: never
across a read or an fsync).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path

from kvtier.auth import UntrustedPath, check_private_dir
from kvtier.cachesvc.disk_records import (
    BadRecord,
    RecordLayout,
    check_key,
    decode,
    encode,
    file_name,
    record_bytes,
)
from kvtier.cachesvc.disk_scan import read_file, scan

log = logging.getLogger("kvtier.cache")

LOCK_FILE = ".kvtier-disk.lock"


class DiskPathError(ValueError):
    """``--disk-path`` cannot be used (missing parent, not writable, full, in use); names the path.

    A ValueError: the service's ``main`` reports it as "cannot start: ..." as it does a bad flag."""


class DiskTier:
    """Block records under ``path``, at most ``budget_bytes`` of record files, LRU.

    ``layout`` is what every record must match to be served (this pool's model fingerprint,
    block size, dtype and block shape); ``queue_blocks`` bounds the write-behind queue (blocks);
    ``verify_s`` is how long the startup scan checksums records before it checks heads only.
    Keys are prefix-index keys (``kvtier.block_hash``: ``parent-or-extra || token bytes``).
    """

    def __init__(
        self,
        path: str | Path,
        budget_bytes: int,
        layout: RecordLayout,
        *,
        queue_blocks: int = 256,
        verify_s: float = 30.0,
    ) -> None:
        self.path = Path(path)
        self.layout = layout
        self.record_size = record_bytes(layout, 32 + 4 * layout.block_size)
        if budget_bytes < self.record_size:
            raise ValueError(
                f"--disk-gib budget of {budget_bytes} bytes is below one record ({self.record_size} bytes)"
            )
        if queue_blocks <= 0:
            raise ValueError(f"write queue of {queue_blocks} blocks must be > 0")
        self.budget_bytes = budget_bytes
        self.queue_blocks = queue_blocks
        self.lock = threading.RLock()
        self.enabled = True
        self.on_change: Callable[[bool, bytes, int], object] | None = None
        """Called ``(stored, key, -1)`` as a record enters (True) or leaves (False) the index,
        on the writer thread or the caller's (the tier's KV events: ``LowerTiers``)."""
        # key -> record file size in bytes, least recently used first.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "writes",
                "skipped_writes",
                "evictions",
                "dropped_at_startup",
                "dropped_on_read",
            ),
            0,
        )
        self._queue: deque[tuple[bytes, bytes | None, bytes]] = deque()
        self._queue_cond = threading.Condition()
        self._writing = 0
        self._closed = False
        self._lock_fd = _open_dir(self.path)
        try:
            self._scan(verify_s)
            self._evict_to(self.budget_bytes)
            self._check_writable()
        except BaseException:
            os.close(self._lock_fd)
            raise
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

    def _check_writable(self) -> None:
        """DiskPathError unless one record fits on the filesystem and a file can be written and synced."""
        free = shutil.disk_usage(self.path).free
        if free < self.record_size:
            raise DiskPathError(
                f"--disk-path {self.path} is full: {free} bytes free, one record takes {self.record_size}"
            )
        if free + self._bytes < self.budget_bytes:
            log.warning(
                "disk tier %s: budget %.1f MiB but only %.1f MiB free; writes will fail, and disable the tier, "
                "when it fills", self.path, self.budget_bytes / 2**20, (free + self._bytes) / 2**20,
            )  # fmt: skip
        probe = self.path / f".probe.{os.getpid()}.tmp"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, b"kvtier")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise DiskPathError(f"--disk-path {self.path} is not writable: {e.strerror or e}") from None

    # ------------------------------------------------------------------ the service's side

    def offer(self, key: bytes, parent_hash: bytes | None, payload) -> bool:
        """Queue one block for writing; False (counted as skipped) if the queue is full or the tier off.

        ``payload`` is the block's bytes (any bytes-like object or a CPU tensor); it is copied
        here, so the caller may reuse its memory when this returns. Never blocks on the disk.
        ValueError for a key or payload that does not fit this tier's layout.
        """
        check_key(self.layout, key, parent_hash)
        with self._queue_cond:
            if not self.enabled or self._closed or len(self._queue) >= self.queue_blocks:
                self._counts["skipped_writes"] += 1
                return False
            data = _copy_bytes(payload)
            if len(data) != self.layout.block_bytes:
                raise ValueError(
                    f"payload of {len(data)} bytes; a block of this tier is {self.layout.block_bytes}"
                )
            self._queue.append((key, parent_hash, data))
            self._queue_cond.notify()
        return True

    def lookup_chain(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` have a record (not verified until ``load``). Changes nothing."""
        index = self._index
        n = 0
        if not self.enabled:
            return 0
        with self.lock:
            for key in keys:
                if key not in index:
                    break
                n += 1
        return n

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
            data, _ = read_file(self.path / name)
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

        from kvtier.cachesvc.host_slots import copy_block

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
        with self.lock:
            out = {"blocks": len(self._index), "bytes": self._bytes, **self._counts}
        out.update(
            budget_bytes=self.budget_bytes, queue_depth=len(self._queue), queue_blocks=self.queue_blocks,
            enabled=self.enabled,
        )  # fmt: skip
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
                item = self._queue.popleft()
                self._writing = 1
            try:
                if self.enabled:
                    self._write(*item)
                    if not self._queue:
                        _fsync_dir(self.path)
            except Exception as e:  # noqa: BLE001 - the writer must not die silently: the tier goes off
                self._disable(f"writing {file_name(item[0])}: {e}")
            finally:
                with cond:
                    self._writing = 0
                    cond.notify_all()

    def _write(self, key: bytes, parent_hash: bytes | None, payload: bytes) -> None:
        """One record: temp file, fsync, rename; then it enters the index, evicting LRU records."""
        if key in self._index:
            return
        buffers = encode(self.layout, key, parent_hash, payload)
        size = sum(memoryview(b).nbytes for b in buffers)
        self._evict_to(self.budget_bytes - size)
        name = file_name(key)
        temp = self.path / f".{name}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                with open(fd, "wb", closefd=False) as f:
                    for b in buffers:
                        f.write(b)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, self.path / name)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        with self.lock:
            if not self.enabled:
                return
            self._index[key] = size
            self._bytes += size
            self._counts["writes"] += 1
        self._changed(True, [key])

    def _evict_to(self, limit: int) -> None:
        """Delete least recently used records until the index holds at most ``limit`` bytes."""
        while True:
            with self.lock:
                if self._bytes <= limit or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._bytes -= size
                self._counts["evictions"] += 1
            self._changed(False, [key])
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path / file_name(key))

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

    def indexed_keys(self) -> list[bytes]:
        """The keys of the indexed records, least recently used first (a copy)."""
        with self.lock:
            return list(self._index)

    def _changed(self, stored: bool, keys: list[bytes]) -> None:
        if self.on_change is not None:
            for key in keys:
                self.on_change(stored, key, -1)


def _open_dir(path: Path) -> int:
    """Create ``path`` (0700) if missing, check it is private, lock it; the lock file's fd."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise DiskPathError(f"--disk-path {path} cannot be created: {e.strerror or e}") from None
    try:
        check_private_dir(path)
    except UntrustedPath as e:
        raise UntrustedPath(f"--disk-path refused: {e}") from None
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise DiskPathError(f"--disk-path {path} is not writable: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskPathError(
            f"--disk-path {path} is in use by another cache service (its {LOCK_FILE} is locked)"
        ) from None
    return fd


def _fsync_dir(path: Path) -> None:
    """Make the renames in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_bytes(payload) -> bytes:
    """A private copy of a bytes-like object or a CPU tensor's bytes."""
    if hasattr(payload, "numpy"):  # a torch tensor (bfloat16 has no numpy dtype: view as bytes)
        import torch

        return payload.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return bytes(memoryview(payload).cast("B"))
