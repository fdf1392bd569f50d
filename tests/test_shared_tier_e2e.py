"""The shared tier through real nodes: `kvtier up --nodes 2 --shared-tier`'s stack (MultiNodeStack
with a real mooncake_master and store server), one replica per node, the defaults otherwise
(host cache auto, --shared-tier-policy through). Three tenants with their own API keys, the
store in strict multi-tenant mode as `kvtier up --api-keys` runs it (the api-keys file is the
cache's --tenant-quotas: the store master's tenant policy is written from it); "tiny"'s quota in
the store is smaller than one block.

Module order matters and is the order below: the master is killed and restarted in the
second-to-last test, node A is SIGKILLed in the last."""

from __future__ import annotations

import json
import signal

import pytest
from servers import ModuleLoop, child_env, greedy_request, wait_until, wait_until_async

from kvtier.block_hash import extra_key, hash_preimage, pack_token_ids
from kvtier.cache_client import CacheClient
from kvtier.cli.stack import MultiNodeStack
from kvtier.compute_client import ComputeClient
from kvtier.model_spec import TINY_LLAMA_CONFIG

try:
    import mooncake.store as mooncake_store
except ImportError as e:  # the wheel, or libibverbs1 / librdmacm1 (scripts/setup.sh)
    pytest.skip(
        f"Mooncake Store's client cannot load ({e}): install kvtier[mooncake]", allow_module_level=True
    )

LOOP = ModuleLoop()
BS = 16
PREFIX = 63 * BS  # 1,008 tokens: 63 full blocks (the tiny model holds 1,024 positions)
BOS = TINY_LLAMA_CONFIG["bos_token_id"]
KEYS = {
    "acme": "sk-acme-shared-tier-test",
    "globex": "sk-globex-shared-tier-test",
    "tiny": "sk-tiny-shared-tier-test",
}


def prompt(seed: int, length: int = PREFIX) -> list[int]:
    return [BOS, *[1 + (seed * 131 + 7 * k + k * k % 13) % 250 for k in range(length - 1)]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("shared")
    keys_file = run_dir / "api-keys.json"
    tenants = {t: {"keys": [k]} for t, k in KEYS.items()}
    tenants["tiny"]["shared_gib"] = 1e-6  # about 1 KiB: no block fits
    keys_file.write_text(json.dumps({"tenants": tenants}))
    s = MultiNodeStack(
        run_dir,
        2,
        ["--tenant-quotas", str(keys_file)],
        ["--api-keys", str(keys_file)],
        num_replicas=1,
        env=child_env(run_dir),
        shared_tier_gib=0.5,
    )
    with s:
        yield s


def generate(node, token_ids: list[int], tenant: str = "acme", max_tokens: int = 8):
    async def run():
        client = ComputeClient(node.compute_addresses, KEYS[tenant])
        try:
            return await client.complete(greedy_request(token_ids, max_tokens))
        finally:
            await client.close()

    return LOOP.run(run())


def shared_row(node):
    """The node's GetStats row of the shared tier."""
    client = CacheClient.connect(node.cache_address, child_env(node.run_dir)["KVTIER_TOKEN"], timeout_s=5.0)
    try:
        (row,) = [t for t in client.get_stats().tiers if t.medium == "shared"]
        return row
    finally:
        client.close()


def stored_on(node, at_least: int, timeout_s: float = 60.0) -> None:
    """Wait until ``node`` has put ``at_least`` blocks in the store (the writer is behind the call)."""
    wait_until(lambda: shared_row(node).num_stored_blocks >= at_least, timeout_s, f"{at_least} blocks stored")


def test_every_node_connects_to_the_store_at_its_first_try(stack):
    """Both nodes run on one host: each transfer engine registers under a name of its own (two
    named 127.0.0.1 collided, the second node's tier was down for its first probe interval and
    whether the next test hit on B depended on how long the replicas took to start)."""
    connected = "shared tier: connected to mooncake://"
    for node in stack.nodes:
        wait_until(lambda n=node: connected in n.cache.log(), 60.0, "the node's store client connected")
        assert "cannot connect to the store's master" not in node.cache.log(), node.run_dir


def test_a_prefix_computed_on_node_a_hits_on_node_b_through_the_store(stack):
    a, b = stack.nodes
    tokens = prompt(1)
    on_a = generate(a, tokens)
    assert on_a.cached_prompt_tokens == 0
    stored_on(a, PREFIX // BS - 1)
    promoted = shared_row(b).num_promotions
    on_b = generate(b, tokens)
    fresh = generate(b, tokens, tenant="globex")  # another tenant: recomputed from nothing on B
    assert on_b.cached_prompt_tokens >= PREFIX - BS  # every full block but the last token's
    assert fresh.cached_prompt_tokens == 0
    assert on_b.token_ids == fresh.token_ids == on_a.token_ids
    assert shared_row(b).num_promotions - promoted >= PREFIX // BS - 1


def test_two_tenants_never_see_each_others_objects(stack):
    a, b = stack.nodes
    tokens = prompt(2)
    generate(a, tokens, tenant="acme")
    stored_on(a, 2 * (PREFIX // BS - 1))
    assert generate(b, tokens, tenant="globex").cached_prompt_tokens == 0
    assert generate(b, tokens, tenant="acme").cached_prompt_tokens >= PREFIX - BS


def node_layout(node):
    from kvtier.cachesvc.disk_records import RecordLayout

    client = CacheClient.connect(node.cache_address, child_env(node.run_dir)["KVTIER_TOKEN"], timeout_s=5.0)
    try:
        client.attach("shared-tier-test")
        spec = client.pool  # the lease expires on its own
    finally:
        client.close()
    return RecordLayout(
        spec.model_fingerprint, spec.block_size, spec.dtype, tuple(spec.shape[1:]), spec.block_bytes
    )


def chain_keys(tokens: list[int], salt: str, model: str) -> list[bytes]:
    parent, data, keys = extra_key(model, salt), pack_token_ids(tokens), []
    for i in range(len(tokens) // BS):
        keys.append(parent + data[i * 4 * BS : (i + 1) * 4 * BS])
        parent = hash_preimage(keys[-1])
    return keys


def test_a_damaged_object_and_another_models_object_are_never_served(stack):
    from kvtier.api_keys import tenant_salt
    from kvtier.cachesvc.disk_records import RecordLayout
    from kvtier.cachesvc.shared_tier import encode_object, object_name

    a, b = stack.nodes
    layout = node_layout(a)
    damaged, forged = prompt(3), prompt(4)
    generate(a, damaged)
    generate(a, forged)
    stored_on(a, 4 * (PREFIX // BS - 1))
    salt = tenant_salt("acme", "")
    raw = raw_client(stack, "acme")
    try:
        # A flipped byte in block 10 of one prefix, through the store's own client.
        keys = chain_keys(damaged, salt, layout.model_fingerprint)
        name = object_name(layout, keys[10])
        data = bytearray(raw.get(name))
        data[len(data) // 2] ^= 0x01
        assert raw.upsert(name, bytes(data)) == 0
        # Another model's record of block 0 of the other prefix, under our model's object name.
        keys = chain_keys(forged, salt, layout.model_fingerprint)
        other = RecordLayout(
            "another-model", layout.block_size, layout.dtype, layout.shape, layout.block_bytes
        )
        record = b"".join(encode_object(other, keys[0], bytes(layout.block_bytes)))
        assert raw.upsert(object_name(layout, keys[0]), record) == 0
    finally:
        raw.close()
    fresh = generate(b, damaged, tenant="globex")
    got = generate(b, damaged)
    assert got.cached_prompt_tokens == 10 * BS  # the chain stops at the damaged block
    assert got.token_ids == fresh.token_ids
    got = generate(b, forged)
    assert got.cached_prompt_tokens == 0
    assert got.token_ids == generate(b, forged, tenant="globex").token_ids


def raw_client(stack, tenant: str):
    """Mooncake's own client, as kvtier's ``tenant`` (its objects live in that tenant's namespace)."""
    from kvtier.api_keys import store_tenant

    raw = mooncake_store.MooncakeDistributedStore()
    master, metadata = stack.store.url.removeprefix("mooncake://"), stack.store.metadata_url
    assert (
        raw.setup(
            "127.0.0.1", metadata, 0, 16 << 20, "tcp", "", master, None, False, "", store_tenant(tenant)
        )
        == 0
    )
    return raw


def test_a_tenant_over_its_quota_in_the_store_still_completes_and_is_counted(stack):
    """Mooncake refuses every put of "tiny" (TENANT_QUOTA_EXCEEDED: a block is larger than its
    quota): its request completes all the same, the refusals are counted as skipped blocks with one
    WARNING naming the tenant, and B recomputes its prefix; the other tenants keep storing."""
    a, b = stack.nodes
    tokens = prompt(11)
    skipped, stored = shared_row(a).num_skipped_blocks, shared_row(a).num_stored_blocks
    on_a = generate(a, tokens, tenant="tiny")
    assert on_a.completion_tokens == 8
    wait_until(
        lambda: shared_row(a).num_skipped_blocks - skipped >= PREFIX // BS - 1, 60.0, "refusals counted"
    )
    assert shared_row(a).num_stored_blocks == stored
    assert a.cache.log().count("kvtier.tiny is at its quota") == 1
    on_b = generate(b, tokens, tenant="tiny")
    assert on_b.cached_prompt_tokens == 0 and on_b.token_ids == on_a.token_ids
    generate(a, prompt(12))  # acme stores on
    stored_on(a, stored + PREFIX // BS - 1)
    assert generate(b, prompt(12)).cached_prompt_tokens >= PREFIX - BS


def test_the_routers_shared_index_drops_what_the_store_lost(stack):
    """A real router follows both nodes: the prefix A wrote through is a shared hit it predicts on
    B; once the store has lost it (removed through its own client), B's lookup misses, B's event
    says so and the router's index of the shared tier shrinks: the hit is no longer predicted."""

    from kvtier.api_keys import tenant_salt
    from kvtier.cachesvc.shared_tier import object_name
    from kvtier.gateway.discovery import Node
    from kvtier.gateway.index_follower import predicted_hit
    from kvtier.gateway.router import Router

    a, b = stack.nodes
    layout, tokens = node_layout(a), prompt(13)
    before = shared_row(a).num_stored_blocks
    generate(a, tokens)
    stored_on(a, before + PREFIX // BS - 1)
    keys = chain_keys(tokens, tenant_salt("acme", ""), layout.model_fingerprint)
    hashes = [hash_preimage(k) for k in keys]
    nodes = [Node(f"node-{i}", n.cache_address, n.compute_addresses) for i, n in enumerate(stack.nodes)]
    router = Router(nodes, child_env(a.run_dir)["KVTIER_TOKEN"], layout.model_fingerprint)
    on_b = router.states[1]

    def shared_on_b() -> int:
        return predicted_hit(on_b, hashes, len(tokens)).below.get("shared", 0)

    LOOP.run(router.start())
    try:
        LOOP.run(wait_until_async(lambda: shared_on_b() >= PREFIX - BS, 60.0, "A's prefix predicted on B"))
        raw = raw_client(stack, "acme")
        try:
            assert raw.batch_remove([object_name(layout, k) for k in keys], True) == [0] * len(keys)
        finally:
            raw.close()
        assert generate(b, tokens).cached_prompt_tokens == 0  # a miss: recomputed
        LOOP.run(wait_until_async(lambda: shared_on_b() == 0, 60.0, "the lost prefix dropped"))
    finally:
        LOOP.run(router.close())


def test_master_killed_mid_run_no_request_fails_and_objects_hit_again_after_its_restart(stack):
    a, b = stack.nodes
    stack.store.kill_master()
    for seed in (5, 6):  # no request fails: the nodes recompute
        assert generate(a, prompt(seed)).completion_tokens == 8
        assert generate(b, prompt(seed)).cached_prompt_tokens == 0
    stack.store.start_master()

    def stored_and_hit(seeds=iter(range(100, 200))) -> bool:
        tokens, before = prompt(next(seeds)), shared_row(a).num_stored_blocks
        generate(a, tokens)
        try:
            stored_on(a, before + PREFIX // BS - 1, timeout_s=10.0)
        except AssertionError:
            return False  # A's tier not back yet: its blocks were not stored
        return generate(b, tokens, max_tokens=1).cached_prompt_tokens >= PREFIX - BS

    wait_until(stored_and_hit, 120.0, "a prefix stored after the master's restart to hit on the other node")


def test_node_a_sigkilled_its_prefixes_still_hit_on_node_b(stack):
    a, b = stack.nodes
    tokens = prompt(7)
    before = shared_row(a).num_stored_blocks
    generate(a, tokens)
    stored_on(a, before + PREFIX // BS - 1)
    for p in a.processes:
        p.stop(signal.SIGKILL)
    assert generate(b, tokens).cached_prompt_tokens >= PREFIX - BS
