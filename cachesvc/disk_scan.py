"""The disk tier's warm restart: its index rebuilt from the record files themselves, in bounded time.

Every ``*.kvb`` file in the directory is checked before it is indexed: its length against its
head, its header against this pool's layout, its key against its file name
(``cachesvc.disk_records``). For the first ``verify_s`` seconds of the scan each record is also
read whole and its checksum checked; after that only its head is read (a few hundred bytes), so
a directory of any size opens in about ``verify_s`` plus one small read per file, and the
records not verified here have their checksum checked when they are first read (``DiskTier.load``
checks every read anyway). A temporary file left by an interrupted write, a torn, truncated or
corrupt record and another pool's record are deleted, each with a log line naming the file and
the reason (the first ``MAX_DROP_LOG_LINES``, then a count). Progress is logged every
``SCAN_LOG_S`` seconds. The records come back oldest mtime first: the LRU order (a hit sets a
record's mtime).

Nothing under a record's name can hang or exhaust a start. A directory, symlink, FIFO, socket or
device is skipped without being opened (the directory entry's type says what it is), with a
warning, and left in place; a file whose size is not one a record of this layout has
(``record_sizes``) is never read whole: at most its head is read, to name the reason it is
dropped. Every open is ``O_NOFOLLOW | O_NONBLOCK`` and checks that it got a regular file, so an
entry swapped for a FIFO after the listing cannot block either.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.cachesvc.disk_records import (
    KEY_PREFIX_BYTES,
    SUFFIX,
    BadRecord,
    RecordLayout,
    decode,
    decode_head,
    encode,
    head_bytes_needed,
)

log = logging.getLogger("kvtier.cache")

SCAN_LOG_S = 2.0
MAX_DROP_LOG_LINES = 50  # per scan: a directory of another model's records logs a summary after these
HEAD_READ_BYTES = 4096  # one read covers the head of a record of any block size we make
_TEMP = re.compile(r"^\.[0-9a-f]{64}\.kvb\.\d+\.tmp$")


@dataclass
class ScanResult:
    """What a scan found: ``records`` as ``(key, file bytes)``, least recently used first."""

    records: list[tuple[bytes, int]] = field(default_factory=list)
    dropped: int = 0
    skipped: int = 0  # entries under a record's name that are not regular files (left in place)
    verified: int = 0  # records whose checksum was checked during the scan
    seconds: float = 0.0


def scan(path: Path, layout: RecordLayout, verify_s: float) -> ScanResult:
    """Index ``path``'s good records; delete temp files and bad records (see the module docstring)."""
    started = last_log = time.monotonic()
    entries = sorted(os.scandir(path), key=lambda e: e.name)
    result = ScanResult()
    found: list[tuple[float, bytes, int]] = []
    for i, entry in enumerate(entries):
        name = entry.name
        now = time.monotonic()
        if now - last_log >= SCAN_LOG_S:
            last_log = now
            log.info("disk tier %s: scanned %d of %d files", path, i, len(entries))
        if not (_TEMP.match(name) or name.endswith(SUFFIX)):
            continue
        if not entry.is_file(follow_symlinks=False):  # the entry's type, no open (and mostly no stat)
            _skip(path, name, _kind(entry), result)
            continue
        if _TEMP.match(name):
            _drop(path, name, "a temporary file left by an interrupted write", result)
            continue
        try:
            key, size, mtime, verified = _check_record(path / name, layout, now - started < verify_s)
            result.verified += verified
            found.append((mtime, key, size))
        except NotRegularFile as e:  # swapped since the listing
            _skip(path, name, str(e), result)
        except BadRecord as e:
            _drop(path, name, str(e), result)
        except FileNotFoundError:
            continue
        except OSError as e:  # an unreadable file
            _drop(path, name, f"unreadable: {e.strerror or e}", result)
    more = result.dropped + result.skipped - MAX_DROP_LOG_LINES
    if more > 0:
        log.warning("disk tier %s: dropped or skipped %d more files (not logged one by one)", path, more)
    result.records = [(key, size) for _, key, size in sorted(found, key=lambda f: f[0])]
    result.seconds = time.monotonic() - started
    return result


def _check_record(path: Path, layout: RecordLayout, whole: bool) -> tuple[bytes, int, float, bool]:
    """``(key, size, mtime, verified)`` of the record file ``path``, or BadRecord / NotRegularFile.

    ``whole``: read the record whole and check its checksum too; otherwise read only its head. A
    file of a size no record of this layout has is never read whole: its head says why it is bad.
    """
    fd, st = _open_regular(path)
    try:
        size = st.st_size
        if size not in record_sizes(layout):
            try:
                decode_head(layout, _read_head(fd, size), size, path.name)
                why = "not a record of this pool"
            except BadRecord as e:
                why = str(e)
            raise BadRecord(f"{_size_mismatch(layout, size)}: {why}")
        if whole:
            key, _ = decode(layout, _read_all(fd, size), path.name)
        else:
            key = decode_head(layout, _read_head(fd, size), size, path.name)
        return key, size, st.st_mtime, whole
    finally:
        os.close(fd)


def _skip(path: Path, name: str, kind: str, result: ScanResult) -> None:
    result.skipped += 1
    if result.dropped + result.skipped <= MAX_DROP_LOG_LINES:
        log.warning(
            "disk tier %s: skipped %s: %s, not a record (never opened; left in place)", path, name, kind
        )


def _kind(entry: os.DirEntry) -> str:
    """What a directory entry that is not a regular file is, in words."""
    try:
        mode = entry.stat(follow_symlinks=False).st_mode
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _drop(path: Path, name: str, reason: str, result: ScanResult) -> None:
    result.dropped += 1
    with contextlib.suppress(OSError):  # an unwritable directory is reported just after the scan
        os.unlink(path / name)
    if result.dropped + result.skipped <= MAX_DROP_LOG_LINES:
        log.warning("disk tier %s: dropped %s: %s", path, name, reason)


def read_file(path: Path, layout: RecordLayout | None = None) -> tuple[bytearray, float]:
    """A file's bytes (writable: a tensor can be made over them without a copy) and its mtime.

    A symlink is not followed and nothing but a regular file is read (NotRegularFile, a BadRecord);
    with ``layout``, a file whose size no record of it has is not read (BadRecord).
    """
    fd, st = _open_regular(path)
    try:
        if layout is not None and st.st_size not in record_sizes(layout):
            raise BadRecord(f"{_size_mismatch(layout, st.st_size)} (not read)")
        return _read_all(fd, st.st_size), st.st_mtime
    finally:
        os.close(fd)


def read_head(path: Path) -> tuple[bytes, int, float]:
    """A record file's head bytes (enough for ``decode_head``), its size and its mtime."""
    fd, st = _open_regular(path)
    try:
        return _read_head(fd, st.st_size), st.st_size, st.st_mtime
    finally:
        os.close(fd)


@functools.cache
def record_sizes(layout: RecordLayout) -> frozenset[int]:
    """Every size a record file of ``layout`` has, in bytes: a sequence's first block (no parent
    hash in its header) and any later one. Measured on the encoder itself."""
    key, payload = bytes(KEY_PREFIX_BYTES + 4 * layout.block_size), bytes(layout.block_bytes)
    return frozenset(
        sum(memoryview(part).nbytes for part in encode(layout, key, parent, payload))
        for parent in (None, key[:KEY_PREFIX_BYTES])
    )


class NotRegularFile(BadRecord):
    """A directory, symlink, FIFO, socket or device under a record's name."""


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symlink",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A read-only fd of the regular file ``path`` and its stat; NotRegularFile otherwise.

    NOTE: O_NONBLOCK, so that opening a FIFO returns at once instead of waiting for a writer
    (it has no effect on a regular file's reads); O_NOFOLLOW: a symlink fails with ELOOP.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile("a symlink") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file"))
    return fd, st


def _size_mismatch(layout: RecordLayout, size: int) -> str:
    return f"{size} bytes; a record of this pool has {' or '.join(map(str, sorted(record_sizes(layout))))}"


def _read_all(fd: int, size: int) -> bytearray:
    data = bytearray(size)
    with open(fd, "rb", closefd=False) as f:
        got = f.readinto(data)
    del data[got:]
    return data


def _read_head(fd: int, size: int) -> bytes:
    head = os.pread(fd, HEAD_READ_BYTES, 0)
    need = head_bytes_needed(head)
    if len(head) < need <= size:
        head = os.pread(fd, need, 0)
    return head
