"""The shared tier below the node's host cache and disk, on test_shared_tier.py's real Mooncake
Store (strict multi-tenant mode: tenants "small" and "big" and the default), under
``--shared-tier-policy evict``: what the host cache and the disk pass down reaches the store as
the tenant whose block it is, also for a disk record written before a restart, and hits for that
tenant only (the default tenant and another one miss it)."""

from __future__ import annotations

import pytest
import torch
from test_shared_tier import LAYOUT, chain, client, rows, store  # noqa: F401 - store: the fixture

from kvtier.cachesvc.disk_records import KEY_PREFIX_BYTES, record_bytes
from kvtier.cachesvc.disk_tier import DiskTier
from kvtier.cachesvc.host_cache import HostCache
from kvtier.cachesvc.lower_tiers import TierStack
from kvtier.cachesvc.shared_tier import SharedTier
from kvtier.cachesvc.tiers import Blocks, Job

FLUSH_S = 60.0
DISK_RECORDS = 4  # the disk's budget, in records


@pytest.fixture(scope="module")
def node_a(store):  # noqa: F811
    tier = SharedTier(client(store), LAYOUT, policy="evict")
    yield tier
    tier.close()


@pytest.fixture(scope="module")
def node_b(store):  # noqa: F811
    tier = SharedTier(client(store), LAYOUT)
    yield tier
    tier.close()


def written(tier: SharedTier, *tenants: str) -> None:
    for tenant in tenants:
        assert tier.clients.of(tenant).wait_written(30.0), tier.clients.of(tenant).stats()


def load_as(tier: SharedTier, keys: list[bytes], tenant: str) -> tuple[int, torch.Tensor]:
    dst = torch.zeros((len(keys), LAYOUT.block_bytes), dtype=torch.uint8)
    tier.submit_load(Job(3, Blocks(keys, dst, list(range(len(keys)))), tenant))
    (result,) = tier.finished_jobs()
    return result.num_done, dst


def only_tenant_sees(node: SharedTier, keys: list[bytes], tenant: str, src: torch.Tensor) -> None:
    """``keys`` are in the store as ``tenant``'s, byte-exact, and no other tenant finds them."""
    assert node.lookup_chain(keys, tenant) == len(keys)
    for other in {"", "small", "big"} - {tenant}:
        assert node.lookup_chain(keys, other) == 0, f"{other or 'the default'} sees {tenant}'s blocks"
    done, dst = load_as(node, keys, tenant)
    assert done == len(keys) and torch.equal(dst, src)


def test_blocks_the_host_cache_evicts_reach_the_store_as_their_tenants(node_a, node_b):
    """Host (2 slots) above the store: big's blocks pushed out by the default tenant's go down as
    big's; the default's given up for swap's slots go down as the default's."""
    pool = torch.cat([rows(2, seed=41), rows(2, seed=42)])
    host = HostCache(2, LAYOUT.block_bytes)
    host.attach_pool(pool)
    stack = TierStack(pool, [host, node_a])
    big = chain(list(range(2000, 2000 + 2 * 4)), salt="tenant:big")
    default = chain(list(range(2100, 2100 + 2 * 4)))
    stack.keep([0, 1], big, ["big", "big"])
    stack.keep([2, 3], default)  # evicts big's two
    written(node_a, "big")
    only_tenant_sees(node_b, big, "big", pool[:2])
    assert node_b.lookup_chain(default) == 0  # still in the host cache only
    stack.reserve(host, 2)  # swap's slots: the default's blocks are given up, down the stack
    written(node_a, "")
    only_tenant_sees(node_b, default, "", pool[2:])


def test_a_disk_record_evicted_after_a_restart_reaches_the_store_as_its_tenant(node_a, node_b, tmp_path):
    """Host (1 slot), disk (4 records) and the store: small's blocks go down to the disk, which
    is closed and opened again (a restart: its index from the records); the default tenant's
    blocks then push small's records out of the disk, read back as small's and stored as
    small's, byte-exact."""
    budget = DISK_RECORDS * record_bytes(LAYOUT, KEY_PREFIX_BYTES + 4 * LAYOUT.block_size)
    small = chain(list(range(2200, 2200 + 3 * 4)), salt="tenant:small")
    pool = rows(8, seed=43)
    host = HostCache(1, LAYOUT.block_bytes)
    disk = DiskTier(tmp_path / "disk", budget, LAYOUT)
    TierStack(pool, [host, disk, node_a]).keep([0, 1, 2], small, ["small"] * 3)  # 2 reach the disk
    assert disk.flush(FLUSH_S) and disk.counts().blocks == 2
    disk.close()

    disk = DiskTier(tmp_path / "disk", budget, LAYOUT)  # the restart
    try:
        assert disk.counts().blocks == 2
        host = HostCache(1, LAYOUT.block_bytes)
        stack = TierStack(pool, [host, disk, node_a])
        default = chain(list(range(2300, 2300 + 5 * 4)))
        stack.keep([3, 4, 5, 6, 7], default)  # 4 reach the disk, which evicts small's 2 to make room
        assert disk.flush(FLUSH_S) and disk.counts().extra["passed_down"] >= 2
        stack.keep([0], chain(list(range(2400, 2404))))  # the next store hands them down
        written(node_a, "small", "")
        only_tenant_sees(node_b, small[:2], "small", pool[:2])
    finally:
        disk.close()
