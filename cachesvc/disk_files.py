"""The disk tier's directory and files: opened, checked and locked at startup; records written in
durable groups (issue 31).

``write_records`` is the one way a record reaches its name: each record is written to a temporary
file in the directory (``.<name>.<pid>.tmp``, which the startup scan deletes), all of the group's
files are made durable together (one ``syncfs`` of the directory's filesystem; an fsync per file
where the C library has none, or when asked, the writer before groups), then each is renamed to
its name and the directory is fsynced once. A record is under its name only once its bytes are
on disk, so a kill at any instant leaves whole, checksummed records (``cachesvc.disk_records``)
and temporary files, never a torn record under a record's name.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from kvtier.auth import UntrustedPath, check_private_dir
from kvtier.cachesvc.disk_records import file_name

log = logging.getLogger("kvtier.cache")

LOCK_FILE = ".kvtier-disk.lock"
_LIBC = ctypes.CDLL(None, use_errno=True)


class DiskPathError(ValueError):
    """``--disk-path`` cannot be used (missing parent, not writable, full, in use); names the path.

    A ValueError: the service's ``main`` reports it as "cannot start: ..." as it does a bad flag."""


def open_dir(path: Path) -> int:
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


def check_writable(path: Path, record_size: int, held_bytes: int, budget_bytes: int) -> None:
    """DiskPathError unless one record fits on the filesystem and a file can be written and synced;
    a warning when the budget is more than the free space (``held_bytes`` are records already there)."""
    free = shutil.disk_usage(path).free
    if free < record_size:
        raise DiskPathError(f"--disk-path {path} is full: {free} bytes free, one record takes {record_size}")
    if free + held_bytes < budget_bytes:
        log.warning(
            "disk tier %s: budget %.1f MiB but only %.1f MiB free; writes will fail, and disable the tier, "
            "when it fills", path, budget_bytes / 2**20, (free + held_bytes) / 2**20,
        )  # fmt: skip
    probe = path / f".probe.{os.getpid()}.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"kvtier")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise DiskPathError(f"--disk-path {path} is not writable: {e.strerror or e}") from None


def write_records(
    path: Path,
    dir_fd: int,
    records: list[tuple[bytes, list]],
    *,
    per_file: bool = False,
    sync_dir: bool = True,
) -> None:
    """Write ``records`` (``(key, buffers)``: ``disk_records.encode``'s buffers) under their names in
    ``path`` durably, as one group (module docstring). ``dir_fd``: any descriptor on the directory's
    filesystem (syncfs's). ``per_file``: an fsync per file instead of one syncfs; ``sync_dir``
    False leaves the directory's fsync to a later group. On an OSError the group's temporary
    files are deleted and the error raised (records already renamed stay: each is whole)."""
    temps: list[Path] = []
    fds: list[int] = []
    try:
        for key, buffers in records:
            temp = path / f".{file_name(key)}.{os.getpid()}.tmp"
            fds.append(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600))
            temps.append(temp)
            _write_all(fds[-1], buffers)
        sync_files(dir_fd, fds, per_file)
        for temp, (key, _) in zip(temps, records, strict=True):
            os.rename(temp, path / file_name(key))
        temps = []
    except OSError:
        for temp in temps:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    if sync_dir:
        fsync_dir(path)


def _write_all(fd: int, buffers: list) -> None:
    """Write ``buffers`` in order: one writev (no copy into a Python buffer), the rest on a short write."""
    done = os.writev(fd, buffers)
    views = [memoryview(b).cast("B") for b in buffers]
    for view in views:
        if done >= view.nbytes:
            done -= view.nbytes
            continue
        view = view[done:]
        done = 0
        while view.nbytes:
            view = view[os.write(fd, view) :]


def sync_files(dir_fd: int, fds: list[int], per_file: bool) -> None:
    """Make the files ``fds`` durable: one ``syncfs`` of the filesystem holding ``dir_fd``, or an
    fsync each (``per_file``, or where the C library has no syncfs)."""
    syncfs = None if per_file else getattr(_LIBC, "syncfs", None)
    if syncfs is None:
        for fd in fds:
            os.fsync(fd)
        return
    if syncfs(dir_fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def fsync_dir(path: Path) -> None:
    """Make the renames in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_bytes(payload) -> np.ndarray:
    """A private copy of a bytes-like object or a CPU tensor's bytes, as a flat uint8 array.

    numpy copies without holding the GIL, so the disk writer's thread keeps writing while a burst
    of blocks is queued (``bytes(...)`` held it: the writer wrote nothing until the burst was in)."""
    if hasattr(payload, "numpy"):  # a torch tensor (bfloat16 has no numpy dtype: view as bytes)
        import torch

        payload = payload.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.frombuffer(memoryview(payload).cast("B"), np.uint8).copy()
