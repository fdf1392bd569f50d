"""The shared tier on a real Mooncake Store: one mooncake_master and store server per module, in
strict multi-tenant mode (what ``kvtier up --shared-tier --api-keys`` runs): tenants "small" (a
quota of 2.5 blocks) and "big", and the default tenant.

First the tier alone (two SharedTier instances stand for two nodes: a block stored by one loads
on the other; a damaged object, another model's object under our name and another tenant's
chain are never served; a tenant at its quota is refused and counted while others store on; no
tenant sees another's object under the same name; what the host cache and the disk (also after a
restart) pass down under policy ``evict`` is stored as its block's tenant's and hits for that
tenant only; what a node finds the store lost leaves its events and the router's index; a
killed master costs bounded calls and the tier comes back on its own), then real nodes
(test_shared_tier_e2e.py's stack)."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from servers import wait_until

from kvtier.block_hash import extra_key, hash_preimage, pack_token_ids
from kvtier.cachesvc.disk_records import KEY_PREFIX_BYTES, RecordLayout, record_bytes
from kvtier.cachesvc.events import tier_kind
from kvtier.cachesvc.shared_tier import SharedTier, encode_object, object_name
from kvtier.cachesvc.store_client import StoreAddress, StoreClient
from kvtier.cachesvc.tiers import Blocks, Job, Lookup

try:
    import mooncake.store as mooncake_store
except ImportError as e:  # the wheel, or libibverbs1 / librdmacm1 (scripts/setup.sh)
    pytest.skip(
        f"Mooncake Store's client cannot load ({e}): install kvtier[mooncake]", allow_module_level=True
    )
from kvtier.cli.store_master import StoreMaster  # noqa: E402

BS = 4
LAYOUT = RecordLayout("model-a-fingerprint", BS, "float32", (2, 2, BS, 1, 8), 2 * 2 * BS * 8 * 4)
TIMEOUT_S = 1.0
RECORD = record_bytes(LAYOUT, KEY_PREFIX_BYTES + 4 * BS)  # one block's object
TENANTS = {
    "small": {"keys": ["sk-small-0123456789abcdef"], "shared_gib": 2.5 * RECORD / 2**30},
    "big": {"keys": ["sk-big-0123456789abcdef"]},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("store")
    keys = run_dir / "api-keys.json"
    keys.write_text(json.dumps({"tenants": TENANTS}))
    with StoreMaster(run_dir, store_gib=0.25, api_keys=str(keys)) as master:
        yield master


def raw_client(store, tenant: str = "kvtier-default"):
    """Mooncake's own client, as ``tenant`` (a name in the master's policy)."""
    raw = mooncake_store.MooncakeDistributedStore()
    master = store.url.split("//")[1]
    assert (
        raw.setup("127.0.0.1", store.metadata_url, 0, 16 << 20, "tcp", "", master, None, False, "", tenant)
        == 0
    )
    return raw


def as_tenant(tier: SharedTier, tenant: str) -> StoreClient:
    """``tier``'s client of ``tenant``, connected."""
    wait_until(lambda: tier.clients.of(tenant).available, 60.0, f"tenant {tenant}'s store client")
    return tier.clients.of(tenant)


def client(store, timeout_s: float = TIMEOUT_S) -> StoreClient:
    c = StoreClient(StoreAddress.parse(store.url, store.metadata_url), timeout_s=timeout_s, probe_s=0.5)
    c.connect()
    wait_until(lambda: c.available, 60.0, "the store client to connect")
    return c


@pytest.fixture(scope="module")
def node_a(store):
    tier = SharedTier(client(store), LAYOUT)
    yield tier
    tier.close()


@pytest.fixture(scope="module")
def node_b(store):
    tier = SharedTier(client(store), LAYOUT)
    yield tier
    tier.close()


def chain(tokens: list[int], salt: str = "", model: str = LAYOUT.model_fingerprint) -> list[bytes]:
    """The prefix-index keys of ``tokens``' full blocks (``kvtier.block_hash``'s chain)."""
    parent, data, keys = extra_key(model, salt), pack_token_ids(tokens), []
    for b in range(len(tokens) // BS):
        keys.append(parent + data[b * 4 * BS : (b + 1) * 4 * BS])
        parent = hash_preimage(keys[-1])
    return keys


def rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, LAYOUT.block_bytes), dtype=torch.uint8, generator=g)


def store_blocks(tier: SharedTier, keys: list[bytes], src: torch.Tensor, tenant: str = "") -> None:
    blocks = Blocks(keys, src, list(range(len(keys))), [tenant] * len(keys))
    assert tier.submit_store(blocks, pass_down=True) is None  # evicts nothing
    client = tier.clients.of(tenant)
    assert client.wait_written(30.0), client.stats()


def load_blocks(tier: SharedTier, keys: list[bytes], tenant: str = "") -> tuple[int, torch.Tensor]:
    dst = torch.zeros((len(keys), LAYOUT.block_bytes), dtype=torch.uint8)
    tier.submit_load(Job(2, Blocks(keys, dst, list(range(len(keys)))), tenant))
    (result,) = tier.finished_jobs()
    return result.num_done, dst


def test_a_block_stored_by_one_node_loads_on_another(node_a, node_b):
    keys = chain(list(range(1, 1 + 5 * BS)))
    src = rows(len(keys), seed=1)
    assert node_b.lookup_chain(keys) == 0
    store_blocks(node_a, keys, src)
    assert node_b.lookup_chain(keys) == len(keys)
    assert node_b.lookup(keys[0]) is Lookup.HIT
    done, dst = load_blocks(node_b, keys)
    assert done == len(keys)
    assert torch.equal(dst, src)
    assert node_b.counts().promotions >= len(keys)


def test_a_damaged_object_is_never_served(store, node_a, node_b):
    keys = chain(list(range(100, 100 + 3 * BS)))
    store_blocks(node_a, keys, rows(3, seed=2))
    raw = raw_client(store)
    name = object_name(LAYOUT, keys[1])
    data = bytearray(raw.get(name))
    data[len(data) // 2] ^= 0xFF  # one payload byte flipped, through the store's own client
    assert raw.upsert(name, bytes(data)) == 0
    bad = node_b.counts().extra["bad_objects"]
    done, _ = load_blocks(node_b, keys)
    assert done == 1  # the chain stops at the damaged block: what follows it is useless
    assert node_b.counts().extra["bad_objects"] == bad + 1
    raw.close()


def test_another_models_object_under_our_name_is_never_served(store, node_a, node_b):
    keys = chain(list(range(200, 200 + 2 * BS)))
    store_blocks(node_a, keys, rows(2, seed=3))
    other = RecordLayout(
        "model-b-fingerprint", *[getattr(LAYOUT, f) for f in ("block_size", "dtype", "shape", "block_bytes")]
    )
    raw = raw_client(store)
    # A name collision: model b's record of the same key, under model a's object name.
    forged = b"".join(encode_object(other, keys[0], rows(1, seed=4)[0].numpy()))
    assert raw.upsert(object_name(LAYOUT, keys[0]), forged) == 0
    done, _ = load_blocks(node_b, keys)
    assert done == 0
    assert object_name(other, keys[0]) != object_name(LAYOUT, keys[0])  # without a forger, names differ
    raw.close()


def test_two_tenants_never_see_each_others_objects(node_a, node_b):
    tokens = list(range(300, 300 + 4 * BS))
    acme, globex = chain(tokens, salt="tenant:acme"), chain(tokens, salt="tenant:globex")
    store_blocks(node_a, acme, rows(4, seed=5))
    assert node_b.lookup_chain(acme) == 4
    assert node_b.lookup_chain(globex) == 0  # the same tokens under another tenant's salt
    done, _ = load_blocks(node_b, globex)
    assert done == 0
    assert not {object_name(LAYOUT, k) for k in acme} & {object_name(LAYOUT, k) for k in globex}


def removed_keys(tier: SharedTier) -> set[bytes]:
    """The keys of ``tier``'s REMOVED events since the last call."""
    kind = tier_kind(False, "shared")
    return {k for record in tier.take_events() if record[0] == kind for k in record[1]}


def test_a_tenant_at_its_quota_is_refused_and_counted_while_another_keeps_storing(node_a, node_b, caplog):
    """Mooncake charges each tenant's objects to its quota: a put over it first evicts the tenant's
    own objects, so it is refused (TENANT_QUOTA_EXCEEDED) only while they are all in use (a read
    leases an object for 10 s). The refusal is the tenant's: counted, one WARNING, the tier stays
    up (the breaker closed) and another tenant keeps storing and hitting."""
    small = as_tenant(node_a, "small")
    as_tenant(node_b, "small"), as_tenant(node_a, "big"), as_tenant(node_b, "big")
    keys = chain(list(range(700, 700 + 3 * BS)), salt="tenant:small")
    store_blocks(node_a, keys[:2], rows(2, seed=9), "small")  # 2 of its 2.5 blocks
    assert node_b.lookup_chain(keys[:2], "small") == 2  # read: both leased now
    node_a.take_events()
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        for _ in range(2):  # refused twice, one WARNING
            store_blocks(node_a, keys[2:], rows(1, seed=10), "small")
    assert small.counts["quota_refused"] == 2 and node_a.counts().extra["quota_refused"] == 2
    warnings = [r.message for r in caplog.records if "TENANT_QUOTA_EXCEEDED" in r.message]
    assert len(warnings) == 1 and "kvtier.small" in warnings[0], warnings
    assert keys[2] in removed_keys(node_a)  # its STORED event is taken back
    assert small.available and node_a.client.available  # not the store's failure: the tier is up
    assert node_b.lookup_chain(keys, "small") == 2 and node_b.lookup(keys[2], "small") is Lookup.MISS
    # Another tenant stores and hits on.
    big = chain(list(range(700, 700 + 3 * BS)), salt="tenant:big")
    store_blocks(node_a, big, rows(3, seed=11), "big")
    done, dst = load_blocks(node_b, big, "big")
    assert done == 3 and torch.equal(dst, rows(3, seed=11))
    assert node_a.counts().extra["tenant_clients"] == 2


def test_no_tenant_sees_another_tenants_object_under_the_same_name(node_a, node_b):
    """Strict mode's namespaces: the very same object name, stored as "big", is nothing to "small"
    (nor to the default tenant); kvtier's salted keys keep names apart anyway (the test above)."""
    keys = chain(list(range(800, 800 + 2 * BS)))  # the same keys (names) asked as every tenant
    store_blocks(node_a, keys, rows(2, seed=12), "big")
    assert node_b.lookup_chain(keys, "big") == 2
    assert node_b.lookup_chain(keys, "small") == 0 and node_b.lookup_chain(keys) == 0
    assert load_blocks(node_b, keys, "small")[0] == 0 and load_blocks(node_b, keys)[0] == 0
    assert keys[0] not in node_b.held_for("small") and keys[0] in node_b.held_for("big")
    done, dst = load_blocks(node_b, keys, "big")  # its own tenant's misses did not forget it
    assert done == 2 and torch.equal(dst, rows(2, seed=12))


def test_a_tenant_missing_from_the_policy_is_refused_with_one_warning_naming_it(node_a, caplog):
    as_tenant(node_a, "nobody")
    keys = chain(list(range(900, 900 + 2 * BS)), salt="tenant:nobody")
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        store_blocks(node_a, keys, rows(2, seed=13), "nobody")
        assert node_a.lookup_chain(keys, "nobody") == 0
    assert node_a.clients.of("nobody").counts["unregistered_tenant"] >= 2
    warnings = [r.message for r in caplog.records if "TENANT_NOT_REGISTERED" in r.message]
    assert len(warnings) == 1 and "kvtier.nobody" in warnings[0], warnings
    assert node_a.client.available  # a configuration error of one tenant: the others go on
    default = chain(list(range(900, 900 + 2 * BS)))
    store_blocks(node_a, default, rows(2, seed=14))
    assert node_a.lookup_chain(default) == 2


def test_what_a_node_finds_the_store_lost_leaves_its_events_and_the_routers_index(store, node_a, node_b):
    """A node says (REMOVED, medium shared) what the store no longer holds when it finds out (a
    lookup or load misses: the first key of the walk), so the router's index of the shared tier,
    the union of every node's events, shrinks with it (gateway.index_follower.apply_run)."""
    from kvtier.gateway.discovery import Node
    from kvtier.gateway.index_follower import NodeState, apply_run, predicted_hit
    from kvtier.sequence_types import HashRun

    keys = chain(list(range(1000, 1000 + 4 * BS)))
    node_a.take_events()
    store_blocks(node_a, keys, rows(4, seed=15))
    peers: list[NodeState] = []
    a, b = (NodeState(Node(name, f"unix:///{name}", []), None, peers=peers) for name in ("a", "b"))
    peers += [a, b]
    for state in peers:
        state.block_size = BS
    stored = [
        k for record in node_a.take_events() if record[0] == tier_kind(True, "shared") for k in record[1]
    ]
    assert stored == keys
    apply_run(a, HashRun(1, "shared", True, [hash_preimage(key) for key in stored]))
    hashes, prompt_len = [hash_preimage(k) for k in keys], 4 * BS + 1
    assert predicted_hit(b, hashes, prompt_len).below == {"shared": 4 * BS}
    raw = raw_client(store)
    assert raw.remove(object_name(LAYOUT, keys[2]), True) == 0  # the store loses block 2
    raw.close()
    node_b.take_events()
    assert load_blocks(node_b, keys)[0] == 2
    assert removed_keys(node_b) == {keys[2]}
    apply_run(b, HashRun(1, "shared", False, [hash_preimage(keys[2])]))  # B's event reaches the router
    assert predicted_hit(b, hashes, prompt_len).below == {"shared": 2 * BS}  # A's report of it went too
    assert predicted_hit(a, hashes, prompt_len).below == {"shared": 2 * BS}
    node_a.lookup(keys[2])  # A, which stored it, finds out too and forgets it
    assert removed_keys(node_a) == {keys[2]} and keys[2] not in node_a.held()
    apply_run(a, HashRun(2, "host", False, [hash_preimage(keys[0])]))  # another medium: that node's only
    assert predicted_hit(b, hashes, prompt_len).below == {"shared": 2 * BS}


def test_blocks_the_device_evicts_go_to_the_store_as_the_tenant_that_published_them(node_a, node_b):
    """Policy ``evict`` with the shared tier the only tier below: the block manager records the
    publishing sequence's tenant per block and returns it with the evictions; the stack hands
    them down as that tenant, and promotes as the asking sequence's tenant."""
    from kvtier.cachesvc.block_manager import BlockManager
    from kvtier.cachesvc.lower_tiers import TierStack

    bm = BlockManager(4, BS)
    bm.keep_evicted = True
    pool = torch.zeros((4, LAYOUT.block_bytes), dtype=torch.uint8)
    stack = TierStack(pool, [node_a])
    tokens = list(range(1100, 1100 + 2 * BS))
    extra = extra_key(LAYOUT.model_fingerprint, "tenant:big")
    ids = bm.allocate(2)
    bm.publish_blocks(ids, [], 0, 2, tokens, extra, tenant="big")
    pool[ids] = rows(2, seed=16)
    bm.free(ids[::-1])
    new = bm.allocate(4)  # every block: the two published ones are evicted
    keys = chain(tokens, salt="tenant:big")
    assert sorted(zip(bm.evicted_ids, bm.evicted_keys, strict=True)) == sorted(zip(ids, keys, strict=True))
    assert [bm.block_tenants[i] for i in ids] == ["big", "big"]
    stack.keep_evicted(bm)
    assert node_a.clients.of("big").wait_written(30.0)
    assert node_b.lookup_chain(keys, "big") == 2 and node_b.lookup_chain(keys, "small") == 0
    assert node_b.lookup_chain(keys) == 0  # nor the default tenant's
    assert stack.held_keys(pack_token_ids(tokens), extra, BS, 0, 2, [], "big") == keys
    assert stack.promote(keys, new[:2], "big") == 2 and torch.equal(pool[new[:2]], rows(2, seed=16))
    assert stack.promote(keys, new[2:], "small") == 0


def written(tier: SharedTier, *tenants: str) -> None:
    for tenant in tenants:
        assert tier.clients.of(tenant).wait_written(30.0), tier.clients.of(tenant).stats()


def only_tenant_sees(node: SharedTier, keys: list[bytes], tenant: str, src: torch.Tensor) -> None:
    """``keys`` are in the store as ``tenant``'s, byte-exact, and no other tenant finds them."""
    assert node.lookup_chain(keys, tenant) == len(keys)
    for other in {"", "small", "big"} - {tenant}:
        assert node.lookup_chain(keys, other) == 0, f"{other or 'the default'} sees {tenant}'s blocks"
    done, dst = load_blocks(node, keys, tenant)
    assert done == len(keys) and torch.equal(dst, src)


def test_blocks_the_host_cache_evicts_reach_the_store_as_their_tenants(node_a, node_b):
    """Policy ``evict``, the host cache (2 slots) above the store: big's blocks pushed out by the
    default tenant's go down as big's; the default's, given up for swap's slots, as the default's."""
    from kvtier.cachesvc.host_cache import HostCache
    from kvtier.cachesvc.lower_tiers import TierStack

    pool = torch.cat([rows(2, seed=41), rows(2, seed=42)])
    host = HostCache(2, LAYOUT.block_bytes)
    host.attach_pool(pool)
    stack = TierStack(pool, [host, node_a])
    big = chain(list(range(2000, 2000 + 2 * BS)), salt="tenant:big")
    default = chain(list(range(2100, 2100 + 2 * BS)))
    stack.keep([0, 1], big, ["big", "big"])
    stack.keep([2, 3], default)  # evicts big's two
    written(node_a, "big")
    only_tenant_sees(node_b, big, "big", pool[:2])
    assert node_b.lookup_chain(default) == 0  # still in the host cache only
    stack.reserve(host, 2)  # swap's slots: the default's blocks are given up, down the stack
    written(node_a, "")
    only_tenant_sees(node_b, default, "", pool[2:])


def test_a_disk_record_evicted_after_a_restart_reaches_the_store_as_its_tenant(node_a, node_b, tmp_path):
    """Policy ``evict``, host (1 slot), disk (4 records) and the store: big's blocks go down to
    the disk, which is closed and opened again (a restart: its index from the records); the
    default tenant's blocks then push big's records out of the disk, read back as big's and
    stored as big's, byte-exact."""
    from kvtier.cachesvc.disk_tier import DiskTier
    from kvtier.cachesvc.host_cache import HostCache
    from kvtier.cachesvc.lower_tiers import TierStack

    budget = 4 * RECORD
    big = chain(list(range(2200, 2200 + 3 * BS)), salt="tenant:big")
    pool = rows(8, seed=43)
    disk = DiskTier(tmp_path / "disk", budget, LAYOUT)
    TierStack(pool, [HostCache(1, LAYOUT.block_bytes), disk, node_a]).keep([0, 1, 2], big, ["big"] * 3)
    assert disk.flush(30.0) and disk.counts().blocks == 2  # the host cache keeps the third
    disk.close()
    disk = DiskTier(tmp_path / "disk", budget, LAYOUT)  # the restart
    try:
        assert disk.counts().blocks == 2
        stack = TierStack(pool, [HostCache(1, LAYOUT.block_bytes), disk, node_a])
        stack.keep([3, 4, 5, 6, 7], chain(list(range(2300, 2300 + 5 * BS))))  # 4 reach the disk: big's go
        assert disk.flush(30.0) and disk.counts().extra["passed_down"] >= 2
        stack.keep([0], chain(list(range(2400, 2400 + BS))))  # the next store to the disk hands them down
        written(node_a, "big", "")
        only_tenant_sees(node_b, big[:2], "big", pool[:2])
    finally:
        disk.close()


def test_the_masters_tenant_policy_is_written_from_the_api_keys_file(store):
    """One tenant per api-keys tenant plus the default, a tenant's ``shared_gib`` its quota, an even
    share of the rest for the others, as the master itself reports them (its admin API); the
    file is the owner's alone."""
    from urllib.request import urlopen

    from kvtier.api_keys import ApiKeys, ApiKeysError

    assert (store.run_dir / "mooncake-tenants.yaml").stat().st_mode & 0o777 == 0o600
    with urlopen(f"{store.metrics_url}/api/v1/tenant_quotas", timeout=10) as reply:
        quotas = {t["tenant_id"]: t["effective_quota_bytes"] for t in json.load(reply)["data"]}
    small = int(TENANTS["small"]["shared_gib"] * 2**30)
    share = (int(0.25 * 2**30) - small) // 2
    assert quotas == {"kvtier.small": small, "kvtier.big": share, "kvtier-default": share}
    for bad in (0, -1, "1"):
        entry = {"keys": ["sk-small-0123456789abcdef"], "shared_gib": bad}
        with pytest.raises(ApiKeysError, match="shared_gib"):
            ApiKeys.parse({"tenants": {"small": entry}})


def test_a_nodes_view_of_the_store_is_bounded_and_its_events_say_what_it_forgets(store):
    """The keys a node says the store holds (its STORED events less its REMOVED ones: what the
    router's index of the shared tier holds for it) never exceed ``known_keys``: the oldest are
    forgotten with a REMOVED event."""
    tier = SharedTier(client(store), LAYOUT, known_keys=4)
    try:
        said: set[bytes] = set()
        for seed in range(3):
            keys = chain(list(range(1200 + 100 * seed, 1200 + 100 * seed + 3 * BS)))
            store_blocks(tier, keys, rows(3, seed=20 + seed))
            for kind, keys_of, _ in tier.take_events():
                said = said | set(keys_of) if kind == tier_kind(True, "shared") else said - set(keys_of)
            assert len(said) == tier.counts().blocks <= 4
        assert said == set(keys) | {chain(list(range(1300, 1300 + 3 * BS)))[-1]}  # the 4 newest
        assert tier.lookup_chain(keys) == 3  # what it forgot the store still holds: asked, found
    finally:
        tier.close()


def test_store_url_is_checked():
    assert StoreAddress.parse("mooncake://10.0.0.5:50051") == StoreAddress(
        "10.0.0.5:50051", "http://10.0.0.5:8080/metadata"
    )
    for bad in ("http://x:1", "mooncake://", "mooncake://h:99999", "mooncake://h:1/path"):
        with pytest.raises(ValueError, match="shared-tier"):
            StoreAddress.parse(bad)


def test_published_blocks_go_to_the_store_under_their_prefix_index_keys(node_a, node_b):
    """Policy ``through``: the block manager's STORED records of a commit are what the node hands
    over; the objects land under the very keys its prefix index uses (and another node's chain)."""
    from kvtier.cachesvc.block_manager import BlockManager

    bm = BlockManager(8, BS)
    tokens = list(range(500, 500 + 3 * BS))
    ids = bm.allocate(3)
    bm.publish_blocks(ids, [], 0, 3, tokens, extra_key(LAYOUT.model_fingerprint))
    src = torch.zeros((8, LAYOUT.block_bytes), dtype=torch.uint8)
    src[ids] = rows(3, seed=8)
    node_a.write_published(bm.take_event_records(), src)
    assert node_a.client.wait_written(30.0)
    keys = [bm.blocks[i].index_key for i in ids]
    assert keys == chain(tokens)
    done, dst = load_blocks(node_b, keys)
    assert done == 3 and torch.equal(dst, src[ids])


# Last: it restarts the master, which the module-scoped clients above would see as the store down.
def test_master_killed_calls_stay_bounded_and_the_tier_comes_back(store, caplog):
    tier = SharedTier(client(store, timeout_s=0.3), LAYOUT)
    try:
        keys = chain(list(range(400, 400 + 2 * BS)))
        store_blocks(tier, keys, rows(2, seed=6))
        store.kill_master()
        with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
            started = time.monotonic()
            for _ in range(5):  # a dead store answers a miss within the bound, every time
                assert tier.lookup_chain(keys) == 0
                assert load_blocks(tier, keys)[0] == 0
            assert time.monotonic() - started < 5 * 2 * 0.3 + 1.0
        assert any("shared tier" in r.message and "recomputing" in r.message for r in caplog.records)
        assert not tier.client.available
        store.start_master()
        # The probe finds the master again; objects stored after the restart hit again.
        wait_until(lambda: tier.client.available, 60.0, "the tier to come back after the master restarted")
        wait_until(lambda: tier.lookup_chain(keys) == 0 and tier.client.available, 30.0, "a clean store")

        def stored_again() -> bool:  # the store server re-registers its memory a moment after the master
            store_blocks(tier, keys, rows(2, seed=7))
            return tier.lookup_chain(keys) == 2

        wait_until(stored_again, 60.0, "objects stored after the restart")
        assert load_blocks(tier, keys)[0] == 2
    finally:
        tier.close()


def test_the_router_prices_a_shared_tier_hit_on_every_node():
    """What one node's cache wrote to the shared tier (its BlockStored events, medium "shared") is a
    hit the router predicts on every node, priced by the media table below a host hit."""
    from kvtier.gateway.discovery import Node
    from kvtier.gateway.index_follower import NodeState, predicted_hit
    from kvtier.gateway.scoring import NodeFigures, rank
    from kvtier.media import medium

    peers: list[NodeState] = []
    a, b = (NodeState(Node(name, f"unix:///{name}", []), None, peers=peers) for name in ("a", "b"))
    peers += [a, b]
    for state in peers:
        state.block_size = BS
    hashes = [hash_preimage(k) for k in chain(list(range(600, 600 + 4 * BS)))]
    a.index("shared").update(hashes)  # node A wrote the prefix through
    a.index("host").update(hashes[:2])
    prompt_len = 4 * BS + 1
    on_a, on_b = predicted_hit(a, hashes, prompt_len), predicted_hit(b, hashes, prompt_len)
    assert on_a.below == {"host": 2 * BS, "shared": 2 * BS}
    assert on_b.below == {"shared": 4 * BS}  # B fetches the whole prefix from the store
    assert predicted_hit(NodeState(Node("c", "unix:///c", []), None), hashes, prompt_len).total == 0
    assert medium("host").price < medium("shared").price < 1.0 and medium("shared").across_nodes
    # B, idle, beats A with work queued; with equal loads A (a host hit) beats B (a store hit).
    figures = [
        NodeFigures(0, outstanding_tokens=4000, below_tokens=on_a.below),
        NodeFigures(0, below_tokens=on_b.below),
    ]
    assert rank(figures, prompt_len, 1.0, 0).order[0] == 1
    figures = [NodeFigures(0, below_tokens=on_a.below), NodeFigures(0, below_tokens=on_b.below)]
    assert rank(figures, prompt_len, 1.0, 0).order[0] == 0
