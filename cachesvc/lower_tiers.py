"""The tiers below the device pool, as one loop: an evicted block goes down, a hit comes back up.

The stack is an ordered list of ``kvtier.cachesvc.tiers.Tier`` (the media of ``kvtier.media``
in rank order, those the flags turn on: the host cache, then the disk), run by ``TierStack``:

- **down** (``keep``): the published blocks an Allocate, Extend or SwapIn evicted from the pool
  (returned by ``BlockManager.take_evicted``, their KV still in the pool's rows) go to the first
  tier's ``submit_store``; what a tier evicts to make room is returned to the loop (its bytes
  copied aside) and goes to the next tier, and so on down (``_down``). With the write policy
  ``through`` every tier also takes the blocks themselves, as soon as the first one does.
  A SwapOut's slots come from the host area (``reserve``): the cached blocks it gives up go down
  the same loop.
- **up** (``promote``): Allocate asks each tier, in order, for the keys of a prompt's chain past
  the device hit (``held_keys``: the ``held`` views, read-only), then copies the held run into the
  sequence's fresh pool blocks with one ``submit_load`` job per run of keys on the same tier,
  waiting for each job's result (``finished_jobs``); a block a tier fails to give (a record
  failing its checks) ends the run. A promoted block stays in its tier.

Keys are prefix-index keys (``kvtier.block_hash``: ``parent-or-extra || token bytes``), so the
parent recorded with a block is its key's first 32 bytes. A tier is found by its medium's name
(``TIER_BUILDERS``); ``add_arguments`` and ``build`` are the flags and the construction, for the
service's config.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.block_hash import hash_preimage
from kvtier.cachesvc import shared_tier
from kvtier.cachesvc.disk_records import RecordLayout
from kvtier.cachesvc.disk_tier import DiskTier
from kvtier.cachesvc.events import EventRecord
from kvtier.cachesvc.tiers import Blocks, Job, Tier
from kvtier.media import LOWER_MEDIA

if TYPE_CHECKING:  # torch loads only with a pool (the flags are parsed without it: fast --help)
    import torch

    from kvtier.cachesvc.host_area import HostArea

WRITE_POLICIES = ("evict", "through")
TENANT_ROOTS = 4096  # chain roots whose tenant the stack remembers (note_tenant), oldest dropped first
LOAD_TIMEOUT_S = 30.0  # the longest a promotion waits for a tier's load job before it counts as a miss


class TierStack:
    """``tiers`` (rank order) below the pool whose block rows are ``pool_rows``.

    ``pool_rows`` is the pool as ``[num_blocks, block_bytes]`` uint8 (``PoolViews.rows``): a
    block is one row, a quantized block's scales included. ``min_hits``: an evicted block hit
    fewer times than this on the device is not kept (``--offload-min-hits``).
    """

    def __init__(
        self, pool_rows: torch.Tensor, tiers: Sequence[Tier], write_policy: str = "evict", min_hits: int = 0
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--disk-write-policy {write_policy!r} is not one of {WRITE_POLICIES}")
        if min_hits < 0:
            raise ValueError(f"--offload-min-hits = {min_hits} must be >= 0")
        if [t.medium.rank for t in tiers] != sorted({t.medium.rank for t in tiers}):
            raise ValueError(f"tiers {[t.medium.name for t in tiers]} are not in rank order, once each")
        self.pool_rows = pool_rows
        self.tiers = list(tiers)
        self.by_name = {t.medium.name: t for t in self.tiers}
        self.write_through = write_policy == "through"
        self.min_hits = min_hits
        # Device hits per published key, kept only while min_hits is set; a key leaves at its
        # eviction (keep), so this holds at most the pool's published blocks.
        self._hits: dict[bytes, int] = {}
        self.num_not_kept = 0  # evicted blocks below min_hits
        self._held = [t.held() for t in self.tiers]  # live views: `key in view` per tier
        # Chain root (extra key) -> tenant, from the last TENANT_ROOTS Allocates of a named tenant:
        # LookupPrefix's queries carry a salt, not a tenant (an unknown root is the default's).
        self._tenants: dict[bytes, str] = {}
        # NOTE: one tier and nothing to filter (the default stack: the host cache alone) has no
        # loop to run: keep hands the blocks straight to it (every evicting Allocate or Extend).
        self._only = self.tiers[0] if len(self.tiers) == 1 and not min_hits else None
        # The host cache alone on a CPU pool (the default stack): its direct store of the pool's
        # rows, which keep_evicted hands the block manager's lists to (Tier.direct_store).
        self._direct = self._only.direct_store(pool_rows) if self._only is not None else None
        self._job_ids = itertools.count(1)

    # ------------------------------------------------------------------ down

    def keep(self, block_ids: Sequence[int], keys: Sequence[bytes], tenants: Sequence[str] = ()) -> None:
        """Take published pool blocks about to be reused (same order as ``keys``, distinct; their
        ``tenants`` if known) down the tiers. Returns once the pool rows may be overwritten. With
        ``min_hits``, a block hit fewer times than that on the device is not kept."""
        if self._only is not None:
            self._only.submit_store(Blocks(keys, self.pool_rows, block_ids, tenants))
            return
        if self.min_hits:
            hits, floor = self._hits, self.min_hits
            kept = [j for j, k in enumerate(keys) if hits.pop(k, 0) >= floor]
            self.num_not_kept += len(keys) - len(kept)
            block_ids, keys = [block_ids[j] for j in kept], [keys[j] for j in kept]
            tenants = [tenants[j] for j in kept] if tenants else ()
        self._down(Blocks(keys, self.pool_rows, block_ids, tenants), 0)

    def _down(self, blocks: Blocks, first: int) -> None:
        """THE LOOP DOWN: ``blocks`` to tier ``first``; what each tier evicts (returned, its bytes
        aside) to the next; under ``through`` the blocks themselves to every tier too."""
        tiers, last = self.tiers, len(self.tiers) - 1
        pending = [blocks]
        for i in range(first, last + 1):
            evicted = [e for b in pending if (e := tiers[i].submit_store(b, pass_down=i < last)) is not None]
            pending = [blocks, *evicted] if self.write_through else evicted
            if not pending:
                return

    def reserve(self, area: HostArea, num_slots: int) -> list[int]:
        """Swap's ``num_slots`` slots of ``area`` (the host cache's, or swap's own area); the cached
        blocks given up for them go down the tiers below it. ResourceExhausted, taking none, if
        the area has fewer slots that are not swap's."""
        at = self.tiers.index(area) if area in self.tiers else len(self.tiers)
        slots, evicted = area.reserve(num_slots, pass_down=at + 1 < len(self.tiers))
        if evicted is not None:
            self._down(evicted, at + 1)
        return slots

    def keep_evicted(self, block_manager) -> None:
        """``keep`` the blocks ``block_manager`` evicted since the last call (``take_evicted``).
        With a direct store, its lists go to the tier as they are and are emptied after (reused:
        no lists, ``Blocks`` or loop per evicting call; the tier keeps no tenant)."""
        if self._direct is not None:
            ids, keys = block_manager.evicted_ids, block_manager.evicted_keys
            if ids:
                self._direct(ids, keys)
                ids.clear()
                keys.clear()
            return
        if block_manager.evicted_ids:
            self.keep(*block_manager.take_evicted(with_tenants=True))

    def note_hits(self, keys: Sequence[bytes]) -> None:
        """Count a device prefix hit on each of ``keys`` (for ``--offload-min-hits``; no-op without it)."""
        if self.min_hits:
            hits = self._hits
            for key in keys:
                hits[key] = hits.get(key, 0) + 1

    # ------------------------------------------------------------------ up

    def holds(self, key: bytes) -> bool:
        """Whether a tier holds ``key`` (read-only: no LRU change)."""
        return any(key in held for held in self._held)

    def lookup_chain(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the tiers hold (each key on any of them)."""
        n = 0
        for key in keys:
            if not self.holds(key):
                break
            n += 1
        return n

    def held_keys(
        self,
        data: bytes,
        parent: bytes,
        block_size: int,
        first: int,
        end: int,
        hashes: list[bytes],
        tenant: str = "",
    ) -> list[bytes]:
        """The keys of a prompt's blocks ``first..end-1`` that a tier holds, leading run only.

        ``data`` is the prompt as ``pack_token_ids`` bytes from token 0, ``parent`` the hash of
        block ``first - 1`` (the extra key at block 0). The hash of each held block is appended
        to ``hashes`` (the sequence's chain, ``first`` long), so publishing it later computes
        nothing again. Read-only; one SHA-256 per held block, none on a miss. ``tenant``: whose
        prompt it is (the shared tier looks in that tenant's namespace).
        """
        step = 4 * block_size
        keys: list[bytes] = []
        views = self._views(tenant)  # holds(), inline: every Allocate's miss asks
        for b in range(first, min(end, len(data) // step)):
            key = parent + data[b * step : (b + 1) * step]
            for held in views:
                if key in held:
                    break
            else:
                break
            keys.append(key)
            parent = hash_preimage(key)
            hashes.append(parent)
        return keys

    def _views(self, tenant: str) -> list:
        """Each tier's ``held`` view as ``tenant`` sees it (the default's: the views kept)."""
        return [t.held_for(tenant) for t in self.tiers] if tenant else self._held

    def note_tenant(self, extra: bytes, tenant: str) -> None:
        """An Allocate of ``tenant`` (not the default) under chain root ``extra``, for ``tenant_of``."""
        roots = self._tenants
        roots[extra] = tenant
        if len(roots) > TENANT_ROOTS:
            del roots[next(iter(roots))]

    def tenant_of(self, extra: bytes) -> str:
        """The tenant an Allocate under chain root ``extra`` named lately; "" (the default) if none."""
        return self._tenants.get(extra, "")

    def count_below(
        self, data: bytes, parent: bytes, block_size: int, first: int, tenant: str = ""
    ) -> tuple[int, ...]:
        """Blocks per lower medium (``kvtier.media.LOWER_MEDIA`` order; each block counted on the
        first tier holding it) of the leading run of a prompt's blocks from block ``first`` on
        (past its device hit; ``parent`` is the hash before it) that the tiers hold
        (``held_keys``' arguments). Read-only, for LookupPrefix."""
        counts = dict.fromkeys((m.name for m in LOWER_MEDIA), 0)
        views = self._views(tenant)
        for key in self.held_keys(data, parent, block_size, first, len(data), [], tenant):
            counts[next(t for t, held in zip(self.tiers, views, strict=True) if key in held).medium.name] += 1
        return tuple(counts.values())

    def promote(self, keys: Sequence[bytes], block_ids: Sequence[int], tenant: str = "") -> int:
        """THE LOOP UP: copy the blocks of the leading held ``keys`` (``tenant``'s prompt) into pool
        blocks ``block_ids``; return how many. One load job per run of keys on the same tier (the
        first tier holding each key); stops at the first key no tier gives. Complete when this returns."""
        n, end = 0, min(len(keys), len(block_ids))
        views = self._views(tenant)
        while n < end:
            at = next((j for j, held in enumerate(views) if keys[n] in held), None)
            if at is None:
                break
            tier, held, stop = self.tiers[at], views[at], n + 1
            while stop < end and keys[stop] in held:
                stop += 1
            blocks = Blocks(keys[n:stop], self.pool_rows, block_ids[n:stop])
            done = self._load(tier, Job(next(self._job_ids), blocks, tenant))
            n += done
            if n < stop:
                break
        return n

    def _load(self, tier: Tier, job: Job) -> int:
        """Submit ``job`` to ``tier`` and wait for its result (``LOAD_TIMEOUT_S``); blocks landed."""
        tier.submit_load(job)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            for result in tier.finished_jobs(max(0.0, deadline - time.monotonic())):
                if result.job_id == job.job_id:
                    return result.num_done
            if time.monotonic() >= deadline:
                return 0

    # ------------------------------------------------------------------ figures and events

    def take_event_records(self) -> list[EventRecord]:
        """Every tier's event records since the last call, tier by tier, each oldest first."""
        return [record for tier in self.tiers for record in tier.take_events()]

    def tier_rows(self) -> list[dict]:
        """Per tier (rank order): node.TierSnapshot's fields."""
        rows = []
        for tier in self.tiers:
            c = tier.counts()
            rows.append({
                "medium": tier.medium.name, "num_blocks": c.blocks, "num_bytes": c.bytes,
                "num_promotions": c.promotions, "num_evictions": c.evictions, "num_stored_blocks": c.stored,
                "num_skipped_blocks": c.skipped, "write_queue_depth": c.queue_depth,
            })  # fmt: skip
        return rows

    def stats(self) -> dict:
        """Per tier: its ``TierCounts`` as a dict (medium-specific figures flattened in)."""
        out: dict = {"not_kept_below_min_hits": self.num_not_kept} if self.min_hits else {}
        for tier in self.tiers:
            c = dataclasses.asdict(tier.counts())
            out[tier.medium.name] = {**c.pop("extra"), **c}
        return out

    def close(self) -> None:
        """Finish what each tier has queued (the disk writes its queue) and release its medium."""
        for tier in self.tiers:
            tier.close()


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


def _host_tier(args: argparse.Namespace, pool_rows: torch.Tensor, layout: RecordLayout) -> Tier | None:
    if not args.host_cache_gib:
        return None
    from kvtier.cachesvc.host_cache import HostCache

    host = HostCache.from_budget(
        int(args.host_cache_gib * 2**30), pool_rows.shape[1], device=pool_rows.device
    )
    host.attach_pool(pool_rows)
    return host


def _disk_tier(args: argparse.Namespace, pool_rows: torch.Tensor, layout: RecordLayout) -> Tier | None:
    if not args.disk_path:
        return None
    if pool_rows.is_cuda and not args.host_cache_gib:
        raise ValueError(
            "--disk-path on a cuda pool needs --host-cache-gib > 0 (disk writes copy from host memory)"
        )
    return DiskTier(args.disk_path, int(args.disk_gib * 2**30), layout, queue_blocks=args.disk_write_queue)


TIER_BUILDERS = {"host": _host_tier, "disk": _disk_tier, "shared": shared_tier.build}
"""Medium name -> ``build(args, pool_rows, layout)``: the tier its flags ask for, or None. A new
tier adds its row to ``kvtier.media`` and its builder (and flags) here."""


def build(
    args: argparse.Namespace, pool_rows: torch.Tensor, layout: RecordLayout
) -> tuple[TierStack | None, HostArea | None]:
    """The tier stack the flags ask for (or None) and swap's host area (the host cache's, else
    ``--swap-space``'s own, else None). ValueError / DiskPathError / UntrustedPath naming a bad flag."""
    for flag in ("host_cache_gib", "disk_gib", "swap_space"):
        if getattr(args, flag, 0) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} = {getattr(args, flag)} must be >= 0")
    tiers: list[Tier] = []
    try:
        for m in LOWER_MEDIA:
            builder = TIER_BUILDERS.get(m.name)  # None: a medium no builder is registered for yet
            tier = builder(args, pool_rows, layout) if builder is not None else None
            if tier is not None:
                tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    stack = TierStack(pool_rows, tiers, args.disk_write_policy, args.offload_min_hits) if tiers else None
    area = stack.by_name.get("host") if stack is not None else None
    if area is None and getattr(args, "swap_space", 0) > 0:
        from kvtier.cachesvc.host_area import HostArea

        area = HostArea.for_pool(pool_rows, int(args.swap_space * 2**30))
    return stack, area
