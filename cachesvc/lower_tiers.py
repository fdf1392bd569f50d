"""The tiers under the device pool as the prefix cache uses them: the host cache, then the disk.

One object for the service to call (issue 22): ``keep`` takes published blocks the device pool
evicts (their KV still in the pool), ``lookup_chain`` says how many of a prompt's next keys a
lower tier holds, ``promote`` copies them into freshly allocated pool blocks. The write policy
says when a block reaches the disk: ``evict`` (when the host cache evicts it, or at once when
there is no host cache) or ``through`` (as soon as the host cache takes it). Keys are
prefix-index keys (``kvtier.block_hash``: ``parent-or-extra || token bytes``), so the parent
recorded with a block is its key's first 32 bytes.

``add_arguments`` and ``from_args`` are the flags and the construction, for the service's config.
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.block_hash import hash_preimage
from kvtier.cachesvc.disk_records import KEY_PREFIX_BYTES, RecordLayout
from kvtier.cachesvc.disk_tier import DiskTier
from kvtier.cachesvc.events import HOST_REPLACED, EventRecord, tier_kind

if TYPE_CHECKING:  # torch loads only with a pool (the flags are parsed without it: fast --help)
    import torch

    from kvtier.cachesvc.host_cache import HostBlockCache

WRITE_POLICIES = ("evict", "through")


class LowerTiers:
    """The host cache and/or the disk tier below the pool whose block rows are ``pool_rows``.

    ``pool_rows`` is the pool as ``[num_blocks, block_bytes]`` uint8 (``PoolViews.rows``): a
    block is one row, a quantized block's scales included.
    """

    def __init__(
        self,
        pool_rows: torch.Tensor,
        host: HostBlockCache | None,
        disk: DiskTier | None,
        write_policy: str = "evict",
        min_hits: int = 0,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--disk-write-policy {write_policy!r} is not one of {WRITE_POLICIES}")
        if min_hits < 0:
            raise ValueError(f"--offload-min-hits = {min_hits} must be >= 0")
        self.pool_rows = pool_rows
        self.host = host
        self.disk = disk
        self.write_policy = write_policy
        self.min_hits = min_hits
        # Device hits per published key, kept only while min_hits is set; a key leaves at its
        # eviction (keep), so this holds at most the pool's published blocks.
        self._hits: dict[bytes, int] = {}
        self.num_not_kept = 0  # evicted blocks below min_hits
        self.promoted = {"host": 0, "disk": 0}  # blocks promote copied into the pool, per tier
        # The tiers' KV events (one record per block, see cachesvc.events), taken by the node
        # after each call; the disk's writer thread appends too (deque appends are atomic).
        self._events: deque[EventRecord] = deque()
        if host is not None:
            host.on_change = self._recorder("host")
            append = self._events.append  # one record per eviction batch: cachesvc.events.HOST_REPLACED
            host.on_replace = lambda old, keys, slots: append((HOST_REPLACED, (*old, *keys), tuple(slots)))
        if disk is not None:
            record = self._recorder("disk")
            disk.on_change = lambda stored, key, block_id: record(stored, (key,), (block_id,))
            for key in disk.indexed_keys():  # records found at startup: a consumer learns what disk holds
                disk.on_change(True, key, -1)
        if host is not None and disk is not None:
            # through: a block the host evicts within the keep that took it has no disk copy yet
            host.on_evict = disk.offer if write_policy == "evict" else self._write_unless_on_disk
        self._on_host = host.held_keys() if host is not None else ()
        if host is not None and disk is None and not min_hits and not pool_rows.is_cuda:
            # The rule with a host cache: the device's eviction hook goes straight to the host
            # cache (every Allocate or Extend that evicts pays for each call on the way).
            host.area.bind_rows(pool_rows)
            self.keep = host.keep_rows

    def _write_unless_on_disk(self, key: bytes, parent_hash: bytes | None, payload) -> bool:
        return self.disk.contains(key) or self.disk.offer(key, parent_hash, payload)

    def _recorder(self, medium: str):
        """``record(stored, keys, block_ids)`` for ``medium``'s tier: one event record of the blocks
        entering or leaving under their index keys (hashed when the record is read: cachesvc.events).
        The host cache's ``on_change`` (one call per batch); the disk's calls it per block."""
        kinds = (tier_kind(False, medium), tier_kind(True, medium))
        append = self._events.append

        def record(stored: bool, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
            append((kinds[stored], tuple(keys), tuple(block_ids)))

        return record

    def take_event_records(self) -> list[EventRecord]:
        """Return and clear the tiers' event records since the last call, oldest first."""
        events = self._events
        if self.disk is None:  # no writer thread: nothing appends meanwhile
            records = list(events)
            events.clear()
            return records
        return [events.popleft() for _ in range(len(events))]  # the writer may append meanwhile

    def note_hits(self, keys: Sequence[bytes]) -> None:
        """Count a device prefix hit on each of ``keys`` (for ``--offload-min-hits``; no-op without it)."""
        if self.min_hits:
            hits = self._hits
            for key in keys:
                hits[key] = hits.get(key, 0) + 1

    def keep(self, block_ids: Sequence[int], keys: Sequence[bytes]) -> int:
        """Take published pool blocks about to be reused (same order as ``keys``); return how many
        a lower tier holds or has queued. Returns once the pool rows may be overwritten. With
        ``min_hits``, a block hit fewer times than that on the device is not kept."""
        if self.min_hits:
            hits, floor = self._hits, self.min_hits
            pairs = [(i, k) for i, k in zip(block_ids, keys, strict=True) if hits.pop(k, 0) >= floor]
            self.num_not_kept += len(keys) - len(pairs)
            block_ids, keys = [i for i, _ in pairs], [k for _, k in pairs]
        rows = self.pool_rows
        if self.host is not None:
            held = self.host.offer_rows(keys, rows, block_ids)
            if self.disk is not None and self.write_policy == "through":
                for key in keys:
                    entry = self.host.entry(key)
                    if entry is not None and not self.disk.contains(key):
                        self.disk.offer(key, key[:KEY_PREFIX_BYTES], self.host.slots[entry.slot])
            return held
        if self.disk is None:
            return 0
        # No host cache: the disk takes device rows directly (a CPU pool; on CUDA a host cache
        # is required, since offer copies from host memory).
        return sum(
            self.disk.offer(k, k[:KEY_PREFIX_BYTES], rows[i]) for i, k in zip(block_ids, keys, strict=True)
        )

    def holds(self, key: bytes) -> bool:
        """Whether the host cache or the disk holds ``key`` (read-only: no LRU change)."""
        return key in self._on_host or (self.disk is not None and self.disk.contains(key))

    def lookup_chain(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the host cache or the disk holds (each key on either)."""
        n = 0
        for key in keys:
            if not self.holds(key):
                break
            n += 1
        return n

    def held_keys(
        self, data: bytes, parent: bytes, block_size: int, first: int, end: int, hashes: list[bytes]
    ) -> list[bytes]:
        """The keys of a prompt's blocks ``first..end-1`` that a lower tier holds, leading run only.

        ``data`` is the prompt as ``pack_token_ids`` bytes from token 0, ``parent`` the hash of
        block ``first - 1`` (the extra key at block 0). The hash of each held block is appended
        to ``hashes`` (the sequence's chain, ``first`` long), so publishing it later computes
        nothing again. Read-only; one SHA-256 per held block, none on a miss.
        """
        step = 4 * block_size
        keys: list[bytes] = []
        on_host, disk = self._on_host, self.disk  # holds(), inline: every Allocate's miss asks
        for b in range(first, min(end, len(data) // step)):
            key = parent + data[b * step : (b + 1) * step]
            if key not in on_host and (disk is None or not disk.contains(key)):
                break
            keys.append(key)
            parent = hash_preimage(key)
            hashes.append(parent)
        return keys

    def count_below(self, data: bytes, parent: bytes, block_size: int, first: int) -> tuple[int, int]:
        """``(host blocks, disk-only blocks)`` of the leading run of a prompt's blocks from block
        ``first`` on (past its device hit; ``parent`` is the hash before it) that the lower tiers
        hold (``held_keys``' arguments). Read-only, for LookupPrefix."""
        keys = self.held_keys(data, parent, block_size, first, len(data), [])
        on_host = sum(1 for key in keys if key in self.host) if self.host is not None else 0
        return on_host, len(keys) - on_host

    def promote(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Copy the blocks of the leading held ``keys`` into pool blocks ``block_ids``; return how many.

        Stops at the first key neither tier can give (a disk record that fails its checks is a
        miss): blocks past it are useless without it. A block promoted from disk is not put back
        in the host cache (it is on the device again). Complete when this returns.
        """
        rows = self.pool_rows
        n = 0
        for key, block_id in zip(keys, block_ids, strict=False):
            if self.host is not None and self.host.load(key, rows[block_id]):
                self.promoted["host"] += 1
            elif self.disk is not None and self.disk.load_into(key, rows[block_id]):
                self.promoted["disk"] += 1
            else:
                break
            n += 1
        return n

    def tier_rows(self) -> list[dict]:
        """Per present tier (host, then disk): medium, blocks, bytes, blocks promoted from it,
        evictions, blocks stored and the write queue's depth (node.TierSnapshot's fields)."""
        rows = []
        for medium, tier, stored in (("host", self.host, "stored"), ("disk", self.disk, "writes")):
            if tier is not None:
                st = tier.stats()
                rows.append({
                    "medium": medium, "num_blocks": st["blocks"], "num_bytes": st["bytes"],
                    "num_promotions": self.promoted[medium], "num_evictions": st["evictions"],
                    "num_stored_blocks": st[stored], "write_queue_depth": st.get("queue_depth", 0),
                })  # fmt: skip
        return rows

    def stats(self) -> dict:
        """Per tier: ``{"host": HostBlockCache.stats(), "disk": DiskTier.stats()}``, present tiers only."""
        out: dict = {"not_kept_below_min_hits": self.num_not_kept} if self.min_hits else {}
        if self.host is not None:
            out["host"] = self.host.stats()
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out

    def close(self) -> None:
        """Write what the disk's queue holds and stop its writer."""
        if self.disk is not None:
            self.disk.close()


AUTO_MAX_GIB = 4.0  # --host-cache-gib auto: at most this much ...
AUTO_SHARE = 0.10  # ... and at most this share of the memory available (other processes need the rest)


def host_cache_gib(value: str) -> float:
    """``--host-cache-gib``'s value: GiB, or ``auto`` (``auto_host_cache_gib``)."""
    return auto_host_cache_gib() if value == "auto" else float(value)


def auto_host_cache_gib(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> float:
    """min(AUTO_MAX_GIB, AUTO_SHARE x the memory available): MemAvailable, or less where a cgroup
    v2 limit leaves less (a container's /proc/meminfo shows the host's memory)."""
    with open(meminfo) as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    try:
        with open(f"{cgroup}/memory.max") as f:
            limit = f.read().strip()
        with open(f"{cgroup}/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit readable: MemAvailable stands
    return min(AUTO_MAX_GIB, AUTO_SHARE * available / 2**30)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The lower tiers' flags (off unless ``--host-cache-gib`` or ``--disk-path`` is given)."""
    ap.add_argument(
        "--host-cache-gib", type=host_cache_gib, default=0.0,
        help="host memory (GiB) for published blocks evicted from the pool, LRU, shared with swap (swap "
        "first: a swap-out evicts cached blocks; --swap-space is then not a second area); 0 = no host cache; "
        f"auto = min({AUTO_MAX_GIB:g} GiB, {AUTO_SHARE * 100:.0f}%% of the memory available to this process)",
    )  # fmt: skip
    ap.add_argument(
        "--disk-path", default="",
        help="directory (created 0700; refused if others can write it) for evicted blocks; off when empty",
    )  # fmt: skip
    ap.add_argument("--disk-gib", type=float, default=16.0, help="budget of --disk-path's records (GiB), LRU")
    ap.add_argument(
        "--disk-write-policy", choices=WRITE_POLICIES, default="evict",
        help="evict: a block reaches the disk when the host cache evicts it; through: when the host cache takes it",
    )  # fmt: skip
    ap.add_argument(
        "--disk-write-queue",
        type=int,
        default=256,
        help="blocks waiting for the disk writer; more are skipped",
    )
    ap.add_argument(
        "--offload-min-hits", type=int, default=0,
        help="keep an evicted block in the lower tiers only if it was hit at least this often on the device",
    )  # fmt: skip


def from_args(args: argparse.Namespace, pool_rows: torch.Tensor, layout: RecordLayout) -> LowerTiers | None:
    """The lower tiers the flags ask for, or None; ValueError / DiskPathError / UntrustedPath naming a bad one."""
    for flag in ("host_cache_gib", "disk_gib"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} = {getattr(args, flag)} must be >= 0")
    if not args.host_cache_gib and not args.disk_path:
        return None
    block_bytes = pool_rows.shape[1]
    host = None
    if args.host_cache_gib:
        from kvtier.cachesvc.host_cache import HostBlockCache

        host = HostBlockCache.from_budget(
            int(args.host_cache_gib * 2**30), block_bytes, device=pool_rows.device
        )
    elif pool_rows.is_cuda:
        raise ValueError(
            "--disk-path on a cuda pool needs --host-cache-gib > 0 (disk writes copy from host memory)"
        )
    disk = None
    if args.disk_path:
        disk = DiskTier(
            args.disk_path, int(args.disk_gib * 2**30), layout, queue_blocks=args.disk_write_queue
        )
    return LowerTiers(pool_rows, host, disk, args.disk_write_policy, args.offload_min_hits)
