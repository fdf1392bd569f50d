"""Content digests of a model's files: blake3 over every byte, cached by each file's identity.

A model's fingerprint (``kvtier.model_spec``) covers the full content of its weight and
tokenizer files, so a checkpoint that differs in one byte never reads another's KV records.
Hashing runs at streaming speed (blake3 over a memory map, multi-threaded where cores allow);
the digest of each file is then kept in a small cache file, ``$XDG_CACHE_HOME/kvtier/
file-digests.json`` (``~/.cache/kvtier/`` by default), under the file's resolved path and its
identity: device, inode, size, mtime and ctime in nanoseconds. A restart of an unchanged model
reads digests from there instead of rehashing; a write to a file changes its ctime (which no
user can set back), so a changed file is always hashed again.

The cache file is written atomically (a temporary file, fsync, rename) under an advisory lock
that also makes the processes of one stack, started together, hash each file once: the first
hashes while the others wait, then read its digests. It carries a sha256 of its entries, checked
on read; a corrupt, foreign or stale cache, or one that cannot be read or written, is ignored
(the files are hashed) and never fails a start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3

log = logging.getLogger("kvtier.model")

FORMAT = "kvtier-file-digests-1 blake3"
CACHE_FILE_NAME = "file-digests.json"
MAX_ENTRIES = 4096  # a user's models' files; entries of deleted or changed files are pruned first
LOCK_WAIT_S = 300.0  # longest wait for another process hashing the same files, then hash here too
LOCK_POLL_S = 0.05
_IDENTITY_FIELDS = ("dev", "ino", "size", "mtime_ns", "ctime_ns")
_HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/kvtier/file-digests.json``, ``~/.cache/kvtier/file-digests.json`` without it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / CACHE_FILE_NAME


def file_identity(st: os.stat_result) -> dict[str, int]:
    """What must be unchanged for a cached digest to stand for the file's bytes."""
    return {
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def hash_file(path: Path) -> str:
    """blake3 hex digest of every byte of ``path``."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest()


@dataclass
class DigestReport:
    """How ``file_digests`` got its answer: for the startup log line and the benchmark."""

    files: int = 0
    total_bytes: int = 0
    hashed_files: int = 0
    hashed_bytes: int = 0
    hash_seconds: float = 0.0
    seconds: float = 0.0
    cache_path: Path | None = None
    cache_note: str = ""  # why the cache was not used or not written, if so

    def describe(self) -> str:
        """One line: files, bytes, how many hashed at what rate, how many from the cache."""
        gib = 2**30
        cached = self.files - self.hashed_files
        line = f"{self.files} files, {self.total_bytes / gib:.2f} GiB in {self.seconds:.2f} s: "
        if self.hashed_files:
            rate = self.hashed_bytes / gib / max(self.hash_seconds, 1e-9)
            line += f"{self.hashed_files} hashed ({self.hashed_bytes / gib:.2f} GiB at {rate:.2f} GiB/s), "
        line += f"{cached} from the digest cache {self.cache_path}"
        return line + (f" ({self.cache_note})" if self.cache_note else "")


def file_digests(paths: list[Path], cache_path: Path | None = None) -> tuple[list[str], DigestReport]:
    """The blake3 digest (hex) of each file in ``paths``, from the digest cache where it holds the
    file's current identity, else hashed (and then stored). ``cache_path`` defaults to
    ``default_cache_path()``."""
    started = time.perf_counter()
    cache_path = cache_path or default_cache_path()
    report = DigestReport(files=len(paths), cache_path=cache_path)
    resolved = [Path(os.path.realpath(p)) for p in paths]
    with _locked(cache_path, report):
        entries = _read_cache(cache_path, report)
        digests, changed = [], False
        for path in resolved:
            identity = file_identity(path.stat())
            report.total_bytes += identity["size"]
            entry = entries.get(str(path))
            if entry is not None and {k: entry[k] for k in _IDENTITY_FIELDS} == identity:
                digests.append(entry["blake3"])
                continue
            t0 = time.perf_counter()
            digest = hash_file(path)
            report.hash_seconds += time.perf_counter() - t0
            report.hashed_files += 1
            report.hashed_bytes += identity["size"]
            digests.append(digest)
            if file_identity(path.stat()) == identity:  # not written while we read it
                entries[str(path)] = {**identity, "blake3": digest}
                changed = True
        if changed and not report.cache_note:
            _write_cache(cache_path, entries, report)
    report.seconds = time.perf_counter() - started
    return digests, report


@contextlib.contextmanager
def _locked(cache_path: Path, report: DigestReport) -> Iterator[None]:
    """Hold the cache's advisory lock (the next process waits, then finds the digests); without
    a lock file (an unwritable cache directory), go on unlocked and do not write the cache.

    NOTE: a holder that never lets go (a stopped process) costs a waiter ``LOCK_WAIT_S``, then it
    hashes on its own: a start is slowed, never hung.
    """
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(cache_path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        report.cache_note = f"not used: {e.strerror or e}"
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    report.cache_note = f"not written: its lock was held for over {LOCK_WAIT_S:.0f} s"
                    break
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _checksum(entries: dict) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def _read_cache(cache_path: Path, report: DigestReport) -> dict[str, dict]:
    """The cache's entries that are well formed; {} for a missing, corrupt or foreign file."""
    if report.cache_note.startswith("not used"):
        return {}
    try:
        data = json.loads(cache_path.read_bytes())
        entries = data["entries"]
        if data.get("format") != FORMAT or data.get("sha256") != _checksum(entries):
            raise ValueError("format or checksum mismatch")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        log.warning("digest cache %s ignored (it is rewritten): %s", cache_path, e)
        return {}
    return {path: entry for path, entry in entries.items() if _well_formed(entry)}


def _well_formed(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and all(type(entry.get(k)) is int for k in _IDENTITY_FIELDS)
        and isinstance(entry.get("blake3"), str)
        and _HEX_DIGEST.match(entry["blake3"]) is not None
    )


def _write_cache(cache_path: Path, entries: dict[str, dict], report: DigestReport) -> None:
    """Write ``entries`` atomically, less those whose file is gone or changed (and, past
    ``MAX_ENTRIES``, all but the last added)."""
    live = {}
    for path, entry in entries.items():
        with contextlib.suppress(OSError):
            if file_identity(os.stat(path)) == {k: entry[k] for k in _IDENTITY_FIELDS}:
                live[path] = entry
    live = dict(list(live.items())[-MAX_ENTRIES:])
    body = json.dumps({"format": FORMAT, "sha256": _checksum(live), "entries": live}, sort_keys=True)
    try:
        fd, temp = tempfile.mkstemp(prefix=f".{CACHE_FILE_NAME}.", suffix=".tmp", dir=cache_path.parent)
        try:
            with open(fd, "w") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, cache_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
    except OSError as e:
        report.cache_note = f"not written: {e.strerror or e}"
