"""The tier contract (cachesvc/tiers.py), one suite run against every implementation.

Each implementation is one entry of ``TIERS``: a name and a function that builds the tier over
real media (host memory, a directory of record files, ...) with room for ``CAPACITY`` blocks of
``LAYOUT``. Adding a tier adds one entry. The suite pins what the tier stack (cachesvc/lower_tiers.py)
relies on: lookup's three answers, stores that read their rows before returning, loads that copy
the leading held run byte-exact and report it through ``finished_jobs``, LRU eviction within the
capacity (evicted blocks handed back with their bytes and tenants when asked), discard, KV-event
records named by the tier's medium, and counts.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_disk_tier import LAYOUT

from kvtier.block_hash import pack_token_ids
from kvtier.cachesvc.disk_records import record_bytes
from kvtier.cachesvc.events import HOST_REPLACED, split_replaced, tier_kind
from kvtier.cachesvc.tiers import Blocks, Job, Lookup, Tier
from kvtier.media import MEDIA

CAPACITY = 4  # blocks each tier is built to hold
SETTLE_S = 60.0  # a deadline for a write-behind tier's progress, not a speed target


def _host(tmp_path: Path) -> Tier:
    from kvtier.cachesvc.host_cache import HostCache

    return HostCache(CAPACITY, LAYOUT.block_bytes)


def _disk(tmp_path: Path) -> Tier:
    from kvtier.cachesvc.disk_tier import DiskTier

    return DiskTier(tmp_path / "disk", CAPACITY * record_bytes(LAYOUT, len(key_of(0))), LAYOUT)


_STORE: list = []  # one Mooncake Store (master + store server) for every shared tier built here


def _shared(tmp_path: Path) -> Tier:
    """Over a real mooncake_master (started once, stopped at exit); each tier its own namespace
    (a model fingerprint of its own: object names differ), so tests never see each other's objects."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:  # the wheel, or libibverbs1 / librdmacm1 (scripts/setup.sh)
        pytest.skip(f"Mooncake Store's client cannot load ({e}): install kvtier[mooncake]")
    import atexit
    import dataclasses

    from kvtier.cachesvc.shared_tier import SharedTier
    from kvtier.cachesvc.store_client import StoreAddress, StoreClient
    from kvtier.cli.store_master import StoreMaster

    if not _STORE:
        _STORE.append(StoreMaster(tmp_path / "store", store_gib=0.25).up())
        atexit.register(_STORE[0].down)
    master = _STORE[0]
    client = StoreClient(StoreAddress.parse(master.url, master.metadata_url), timeout_s=5.0)
    client.connect()
    deadline = time.monotonic() + SETTLE_S
    while not client.available:
        assert time.monotonic() < deadline, "the store client did not connect"
        time.sleep(0.01)  # it connects off this thread
    return SharedTier(client, dataclasses.replace(LAYOUT, model_fingerprint=f"contract-{tmp_path.name}"))


TIERS: dict[str, Callable[[Path], Tier]] = {"host": _host, "disk": _disk, "shared": _shared}
"""Every implementation of the Tier interface: medium name -> build(tmp_path). One entry per tier."""


@pytest.fixture(params=sorted(TIERS))
def tier(request, tmp_path):
    built = TIERS[request.param](tmp_path)
    yield built
    built.close()


def key_of(i: int) -> bytes:
    """A first block's index key: a 32-byte root (an extra key) and ``block_size`` token ids."""
    return hashlib.sha256(b"contract %d" % i).digest() + pack_token_ids([i] * LAYOUT.block_size)


def rows_of(indices) -> torch.Tensor:
    """Pool rows ``[len(indices), block_bytes]`` uint8: row k holds block ``indices[k]``'s bytes."""
    return torch.stack([torch.full((LAYOUT.block_bytes,), i % 251 + 1, dtype=torch.uint8) for i in indices])


def tenant_of(i: int) -> str:
    """Block i's tenant in the tests that name them: the default, or one of two named tenants."""
    return ("", "acme", "globex.eu-1")[i % 3]


def store(tier: Tier, indices, pass_down: bool = False, tenants: bool = False):
    indices = list(indices)
    named = [tenant_of(i) for i in indices] if tenants else ()
    return tier.submit_store(
        Blocks([key_of(i) for i in indices], rows_of(indices), range(len(indices)), named), pass_down
    )


def passed_down(tier: Tier, first: Blocks | None, n: int) -> tuple[list[bytes], torch.Tensor, list[str]]:
    """The ``n`` blocks a tier handed back for the tier below as ``(keys, bytes, tenants)``: those
    ``first`` (a store's return) holds, then what later pass-down stores of nothing return (a
    write-behind tier evicts on its writer, after the store that made it)."""
    keys, rows, tenants = [], [], []
    deadline = time.monotonic() + SETTLE_S
    while True:
        if first is not None:
            keys += first.keys
            rows += [first.rows[i] for i in first.row_ids]
            tenants += first.tenants or [""] * len(first)
        if len(keys) >= n:
            return keys, torch.stack(rows), tenants
        assert time.monotonic() < deadline, f"{tier.medium.name}: {len(keys)} of {n} evictions passed down"
        time.sleep(0.005)
        first = tier.submit_store(
            Blocks([], torch.zeros((0, LAYOUT.block_bytes), dtype=torch.uint8), []), True
        )


def settle(tier: Tier, indices) -> None:
    """Wait until no key of ``indices`` is NOT_YET (a write-behind tier's queue drained)."""
    deadline = time.monotonic() + SETTLE_S
    while any(tier.lookup(key_of(i)) == Lookup.NOT_YET for i in indices):
        assert time.monotonic() < deadline, f"{tier.medium.name}: stores still pending after {SETTLE_S} s"
        time.sleep(0.005)


def load(tier: Tier, indices, job_id: int = 1) -> tuple[int, torch.Tensor]:
    """``submit_load`` of ``indices`` into fresh rows; (blocks landed, the rows)."""
    dst = torch.zeros((len(indices), LAYOUT.block_bytes), dtype=torch.uint8)
    tier.submit_load(Job(job_id, Blocks([key_of(i) for i in indices], dst, range(len(indices)))))
    deadline = time.monotonic() + SETTLE_S
    while True:
        done = {r.job_id: r.num_done for r in tier.finished_jobs(max(0.0, deadline - time.monotonic()))}
        if job_id in done:
            return done[job_id], dst
        assert time.monotonic() < deadline, f"{tier.medium.name}: load job {job_id} never finished"


def events_of(tier: Tier) -> list[tuple[bool, bytes]]:
    """The tier's event records since the last call as ``(stored, key)``, in order."""
    kinds = {tier_kind(True, tier.medium.name): True, tier_kind(False, tier.medium.name): False}
    out = []
    for record in tier.take_events():
        for part in split_replaced(record) if record[0] == HOST_REPLACED else (record,):
            assert part[0] in kinds, f"record kind {part[0]} is not {tier.medium.name}'s"
            out += [(kinds[part[0]], key) for key in part[1]]
    return out


def test_the_medium_is_a_row_of_the_media_table_below_the_device(tier):
    assert tier.medium in MEDIA and tier.medium.rank > 0
    assert tier.block_bytes == LAYOUT.block_bytes


def test_a_stored_block_is_a_hit_and_loads_byte_exact_after_its_rows_were_reused(tier):
    src = rows_of([0, 1])
    assert tier.lookup(key_of(0)) == Lookup.MISS
    tier.submit_store(Blocks([key_of(0), key_of(1)], src, [0, 1]))
    src.zero_()  # the caller reuses its rows as soon as the store returns
    settle(tier, [0, 1])
    assert [tier.lookup(key_of(i)) for i in (0, 1, 2)] == [Lookup.HIT, Lookup.HIT, Lookup.MISS]
    assert key_of(0) in tier.held() and key_of(2) not in tier.held()
    assert tier.lookup_chain([key_of(0), key_of(1), key_of(2), key_of(0)]) == 2
    n, dst = load(tier, [1, 0])
    assert n == 2 and torch.equal(dst, rows_of([1, 0]))
    counts = tier.counts()
    assert (counts.blocks, counts.promotions, counts.hits) == (2, 2, 2)
    assert counts.stored == 2 and counts.skipped == 0 and counts.queue_depth == 0


def test_a_load_copies_the_leading_held_run_and_stops_at_the_first_key_it_cannot_give(tier):
    store(tier, [0, 1, 3])
    settle(tier, [0, 1, 3])
    n, dst = load(tier, [0, 1, 2, 3], job_id=7)
    assert n == 2 and torch.equal(dst[:2], rows_of([0, 1])) and not dst[2:].any()
    assert load(tier, [5], job_id=8)[0] == 0
    assert tier.finished_jobs() == []  # each result is reported once


def test_storing_a_held_key_again_keeps_one_copy(tier):
    store(tier, [0, 1])
    settle(tier, [0, 1])
    store(tier, [1, 0])
    settle(tier, [0, 1])
    assert tier.counts().blocks == 2
    assert [stored for stored, _ in events_of(tier)] == [True, True]


def test_more_blocks_than_the_capacity_evict_the_least_recently_used(tier):
    if tier.medium.across_nodes:
        pytest.skip(
            "the shared tier's capacity is the store's: its master evicts (watermark, leases), not the tier"
        )
    store(tier, range(CAPACITY))
    settle(tier, range(CAPACITY))
    evicted = store(tier, [CAPACITY, CAPACITY + 1], pass_down=True)
    settle(tier, [CAPACITY, CAPACITY + 1])
    assert [tier.lookup(key_of(i)) == Lookup.HIT for i in range(CAPACITY + 2)] == [
        False, False, *[True] * (CAPACITY - 2), True, True,
    ]  # fmt: skip
    counts = tier.counts()
    assert counts.blocks == CAPACITY and counts.evictions == 2
    keys, rows, tenants = passed_down(tier, evicted, 2)  # handed back for the tier below, with their bytes
    assert keys == [key_of(0), key_of(1)] and torch.equal(rows, rows_of([0, 1])) and tenants == ["", ""]
    removed = [key for stored, key in events_of(tier) if not stored]
    assert removed == [key_of(0), key_of(1)]


def test_blocks_passed_down_carry_the_tenants_they_were_stored_with(tier):
    """What a tier hands down reaches the tier below (the shared tier) as its tenant's, however
    it was stored: alone, in a batch, or past the tier's capacity in one go."""
    if tier.medium.across_nodes:
        pytest.skip("the shared tier is the last: the store evicts on its own and passes nothing down")
    store(tier, [0], pass_down=True, tenants=True)
    store(tier, range(1, CAPACITY), pass_down=True, tenants=True)
    settle(tier, range(CAPACITY))
    events_of(tier)
    first = store(tier, range(CAPACITY, 2 * CAPACITY + 2), pass_down=True, tenants=True)  # more than it holds
    settle(tier, range(2 * CAPACITY + 2))
    removed = [key for stored, key in events_of(tier) if not stored]
    assert tier.counts().blocks == CAPACITY and len(removed) == CAPACITY + 2  # within its room, always
    keys, rows, tenants = passed_down(tier, first, len(removed))
    assert keys == removed  # each evicted block handed down once, in eviction order
    blocks = [int(row[0]) - 1 for row in rows]  # rows_of: block i's bytes are i + 1
    assert keys == [key_of(i) for i in blocks] and tenants == [tenant_of(i) for i in blocks]
    assert set(tenants) == {"", "acme", "globex.eu-1"}


def test_discard_forgets_a_block_without_passing_it_down(tier):
    store(tier, [0, 1])
    settle(tier, [0, 1])
    events_of(tier)
    assert tier.discard(key_of(0)) and not tier.discard(key_of(0))
    assert tier.lookup(key_of(0)) == Lookup.MISS and tier.lookup(key_of(1)) == Lookup.HIT
    events = events_of(tier)
    if tier.medium.across_nodes:  # the store's misses are said as found (for the router), maybe again
        events = sorted(set(events))
    assert events == [(False, key_of(0))] and tier.counts().blocks == 1
    assert load(tier, [0])[0] == 0


def test_events_name_every_block_stored_in_order(tier):
    store(tier, [2, 0, 1])
    settle(tier, [0, 1, 2])
    assert events_of(tier) == [(True, key_of(i)) for i in (2, 0, 1)]
    assert events_of(tier) == []
