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
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.cachesvc.disk_records import (
    SUFFIX,
    BadRecord,
    RecordLayout,
    decode,
    decode_head,
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
    verified: int = 0  # records whose checksum was checked during the scan
    seconds: float = 0.0


def scan(path: Path, layout: RecordLayout, verify_s: float) -> ScanResult:
    """Index ``path``'s good records; delete temp files and bad records (see the module docstring)."""
    started = last_log = time.monotonic()
    names = sorted(os.listdir(path))
    result = ScanResult()
    found: list[tuple[float, bytes, int]] = []
    for i, name in enumerate(names):
        now = time.monotonic()
        if now - last_log >= SCAN_LOG_S:
            last_log = now
            log.info("disk tier %s: scanned %d of %d files", path, i, len(names))
        if _TEMP.match(name):
            _drop(path, name, "a temporary file left by an interrupted write", result)
            continue
        if not name.endswith(SUFFIX):
            continue
        full = now - started < verify_s
        try:
            if full:
                data, mtime = read_file(path / name)
                key, _ = decode(layout, data, name)
                size = len(data)
                result.verified += 1
            else:
                head, size, mtime = read_head(path / name)
                key = decode_head(layout, head, size, name)
            found.append((mtime, key, size))
        except BadRecord as e:
            _drop(path, name, str(e), result)
        except FileNotFoundError:
            continue
        except OSError as e:  # a symlink (never followed), an unreadable file
            _drop(path, name, f"unreadable: {e.strerror or e}", result)
    if result.dropped > MAX_DROP_LOG_LINES:
        log.warning(
            "disk tier %s: dropped %d more files (not logged one by one)",
            path,
            result.dropped - MAX_DROP_LOG_LINES,
        )
    result.records = [(key, size) for _, key, size in sorted(found, key=lambda f: f[0])]
    result.seconds = time.monotonic() - started
    return result


def _drop(path: Path, name: str, reason: str, result: ScanResult) -> None:
    result.dropped += 1
    with contextlib.suppress(OSError):  # an unwritable directory is reported just after the scan
        os.unlink(path / name)
    if result.dropped <= MAX_DROP_LOG_LINES:
        log.warning("disk tier %s: dropped %s: %s", path, name, reason)


def read_file(path: Path) -> tuple[bytearray, float]:
    """A file's bytes (writable: a tensor can be made over them without a copy) and its mtime;
    a symlink is not followed."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        data = bytearray(st.st_size)
        with open(fd, "rb", closefd=False) as f:
            got = f.readinto(data)
        del data[got:]
        return data, st.st_mtime
    finally:
        os.close(fd)


def read_head(path: Path) -> tuple[bytes, int, float]:
    """A record file's head bytes (enough for ``decode_head``), its size and its mtime."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        head = os.pread(fd, HEAD_READ_BYTES, 0)
        need = head_bytes_needed(head)
        if len(head) < need <= st.st_size:
            head = os.pread(fd, need, 0)
        return head, st.st_size, st.st_mtime
    finally:
        os.close(fd)
