"""The shared tier on a real Mooncake Store: one mooncake_master and store server per module.

First the tier alone (two SharedTier instances stand for two nodes: a block stored by one loads
on the other; a damaged object, another model's object under our name and another tenant's
chain are never served; a killed master costs bounded calls and the tier comes back on its own),
then real nodes (test_shared_tier_e2e.py's stack)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from servers import wait_until

from kvtier.block_hash import extra_key, hash_preimage, pack_token_ids
from kvtier.cachesvc.disk_records import RecordLayout
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


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with StoreMaster(tmp_path_factory.mktemp("store"), store_gib=0.25) as master:
        yield master


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


def store_blocks(tier: SharedTier, keys: list[bytes], src: torch.Tensor) -> None:
    assert (
        tier.submit_store(Blocks(keys, src, list(range(len(keys)))), pass_down=True) is None
    )  # evicts nothing
    assert tier.client.wait_written(30.0), tier.client.stats()


def load_blocks(tier: SharedTier, keys: list[bytes]) -> tuple[int, torch.Tensor]:
    dst = torch.zeros((len(keys), LAYOUT.block_bytes), dtype=torch.uint8)
    tier.submit_load(Job(2, Blocks(keys, dst, list(range(len(keys))))))
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
    raw = mooncake_store.MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", store.metadata_url, 0, 16 << 20, "tcp", "", store.url.split("//")[1]) == 0
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
    raw = mooncake_store.MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", store.metadata_url, 0, 16 << 20, "tcp", "", store.url.split("//")[1]) == 0
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
