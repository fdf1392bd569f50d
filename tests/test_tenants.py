"""Two kinds of credential, tenants and per-tenant quotas (issue 16, items 1 and 3).

One real stack for the module: a cache service with tenant quotas (the api-keys file's
max_blocks, a per-lease limit), one compute replica that takes client API keys, and a gateway
that forwards each HTTP caller's key and holds no node token. Plus in-process checks of the
api-keys file and of the sequence table's quota accounting.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

import grpc
import openai
import pytest
import torch
from servers import TOKEN, ModuleLoop, cache_service, child_env, greedy_request, wait_until

from kvtier import status
from kvtier.api import cache_pb2
from kvtier.api_keys import ApiKeys, ApiKeysError, ClientKeys, tenant_salt
from kvtier.auth import bearer, grpc_target
from kvtier.cache_client import AllocateItem, CacheClient
from kvtier.cache_errors import NoFreeBlocks
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import ExceedsLimit, ResourceExhausted
from kvtier.cachesvc.host_area import HostArea
from kvtier.cachesvc.limits import fair_shares
from kvtier.cachesvc.sequences import SequenceTable
from kvtier.cli.stack import LocalStack, start_gateway
from kvtier.compute_client import ComputeClient
from kvtier.sequence_types import AllocateItem as TableItem

pytestmark = [pytest.mark.timeout(600)]

LOOP = ModuleLoop()
ACME_KEY = "sk-acme-" + secrets.token_hex(12)
GLOBEX_KEY = "sk-globex-" + secrets.token_hex(12)
ACME_QUOTA = 12  # blocks of 16 tokens
LEASE_LIMIT = 40
KEYS = {
    "tenants": {
        "acme": {"keys": [ACME_KEY], "max_blocks": ACME_QUOTA},
        "globex": {"keys": [GLOBEX_KEY]},
    }
}
PROMPT = [1 + (i * 7) % 250 for i in range(40)]  # two full blocks and a partial one


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys.json"
    path.write_text(json.dumps(KEYS))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, keys_file):
    run_dir = tmp_path_factory.mktemp("tenants")
    cache_args = ["--num-blocks", "64", "--lease-ttl", "2", "--metrics-port", "0"]
    cache_args += ["--tenant-quotas", str(keys_file), "--max-blocks-per-lease", str(LEASE_LIMIT)]
    compute_args = ["--api-keys", str(keys_file), "--admit-timeout-s", "300"]
    with LocalStack(run_dir, cache_args, compute_args, 1, child_env(run_dir)) as s:
        yield s


def generate(stack, key: str, request):
    async def run():
        client = ComputeClient(stack.compute_addresses, key)
        try:
            return await client.complete(request)
        finally:
            await client.close()

    return LOOP.run(run())


def cache_client(stack) -> CacheClient:
    return CacheClient.connect(stack.cache_address, TOKEN, timeout_s=10.0)


# ------------------------------------------------------------------ credentials


def test_a_client_key_cannot_call_any_cache_rpc(stack):
    methods = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].methods
    channel = grpc.insecure_channel(grpc_target(stack.cache_address))
    try:
        for key in (ACME_KEY, GLOBEX_KEY):
            for m in methods:
                path = f"/kvtier.v1.CacheService/{m.name}"
                call = (channel.unary_stream if m.server_streaming else channel.unary_unary)(path)
                with pytest.raises(grpc.RpcError) as refused:
                    reply = call(b"", metadata=bearer(key), timeout=10)
                    if m.server_streaming:
                        next(iter(reply))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (m.name, refused.value)
    finally:
        channel.close()
    # The node token opens the same service (the refusals above are about the key).
    node = cache_client(stack)
    try:
        assert node.get_stats().num_blocks_total == 64
    finally:
        node.close()


def test_generate_takes_client_keys_and_refuses_the_node_token(stack):
    for wrong in (TOKEN, "sk-unknown-" + secrets.token_hex(12)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            generate(stack, wrong, greedy_request(PROMPT[:5], 2))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in refused.value.details()
    done = generate(stack, GLOBEX_KEY, greedy_request(PROMPT[:5], 3))
    assert len(done.token_ids) == 3 and done.finish_reason == "length"


def test_a_tenant_cannot_hit_another_tenants_prefix_with_any_salt(stack):
    salt = "team-salt"
    first = generate(stack, ACME_KEY, greedy_request(PROMPT, 2, cache_salt=salt))
    again = generate(stack, ACME_KEY, greedy_request(PROMPT, 2, cache_salt=salt))
    assert first.cached_prompt_tokens == 0
    assert again.cached_prompt_tokens == 32  # both full blocks: the tenant hits its own prefix
    assert again.token_ids == first.token_ids
    # Another tenant, with the same salt, no salt, or the very salt acme's blocks are hashed with:
    for other_salt in (salt, "", tenant_salt("acme", salt)):
        other = generate(stack, GLOBEX_KEY, greedy_request(PROMPT, 2, cache_salt=other_salt))
        assert other.cached_prompt_tokens == 0, other_salt
        assert other.token_ids == first.token_ids  # same model, same greedy tokens: only the cache differs
    # A router (node credential) finds acme's blocks under the derived salt, and only there.
    client = cache_client(stack)
    try:
        [found] = client.lookup_prefix([PROMPT], tenant_salt=tenant_salt("acme", salt))
        [plain] = client.lookup_prefix([PROMPT], tenant_salt=salt)
    finally:
        client.close()
    assert (found.num_cached_tokens, plain.num_cached_tokens) == (32, 0)


def test_the_gateway_forwards_each_callers_key_and_needs_no_node_token(stack, keys_file, tmp_path):
    env = child_env(stack.run_dir)
    del env["KVTIER_TOKEN"]  # and the run dir holds no token file: the gateway has no node token
    assert not (stack.run_dir / "token").exists()
    gateway = start_gateway(stack.compute_addresses, ["--api-keys", str(keys_file)], tmp_path, env)
    try:
        url = f"{gateway.address}/v1"
        good = openai.OpenAI(base_url=url, api_key=ACME_KEY, max_retries=0, timeout=120)
        reply = good.completions.create(model="kvtier-tiny", prompt=PROMPT[:6], max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
        for wrong in ("sk-wrong-" + secrets.token_hex(12), TOKEN):
            bad = openai.OpenAI(base_url=url, api_key=wrong, max_retries=0, timeout=120)
            with pytest.raises(openai.AuthenticationError) as refused:
                bad.completions.create(model="kvtier-tiny", prompt=PROMPT[:6], max_tokens=3)
            assert refused.value.status_code == 401
            assert refused.value.body["code"] == "invalid_api_key", refused.value.body
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
    finally:
        gateway.stop()


# ------------------------------------------------------------------ quotas


def blocks_item(tenant: str, blocks: int, start: int = 0) -> AllocateItem:
    """An item that holds exactly `blocks` blocks of 16 tokens (distinct tokens: no prefix hit)."""
    return AllocateItem(
        [3 + (start + i) % 250 for i in range(16 * blocks)], tenant_salt=f"q{start}", tenant=tenant
    )


def refused(call) -> NoFreeBlocks:
    with pytest.raises(NoFreeBlocks) as e:
        call()
    assert e.value.code == "RESOURCE_EXHAUSTED", e.value
    return e.value


@contextmanager
def two_leases(address: str):
    """Two cache clients, each attached with a lease of its own: a greedy one and another."""
    greedy = CacheClient.connect(address, TOKEN, timeout_s=10.0)
    other = CacheClient.connect(address, TOKEN, timeout_s=10.0)
    try:
        greedy.attach("greedy")
        other.attach("other")
        yield greedy, other
    finally:
        greedy.close()
        other.close()


def allocated(client: CacheClient, items: list[AllocateItem]) -> list[int]:
    return [s.sequence_id for s in client.allocate(items)]


def test_a_quota_holds_under_a_greedy_lease_and_others_still_allocate(stack):
    with two_leases(stack.cache_address) as (greedy, other):
        held = allocated(greedy, [blocks_item("acme", 4, k * 100) for k in range(3)])
        # acme holds its 12 blocks: one more is refused at once, naming the quota ...
        e = refused(lambda: greedy.allocate([blocks_item("acme", 1, 900)]))
        assert "tenant 'acme' holds 12 of its 12-block quota" in e.details
        assert e.reason == ""  # ... and it would fit once acme's own sequences finish
        # An item larger than the quota can never fit: a different reason, so callers do not wait.
        e = refused(lambda: other.allocate([blocks_item("acme", ACME_QUOTA + 1, 700)]))
        assert e.reason == status.EXCEEDS_LIMIT and "can never fit" in e.details
        # The same lease still allocates for another tenant, up to the per-lease limit.
        held += allocated(greedy, [blocks_item("globex", 4, 200 + k) for k in range(7)])
        e = refused(lambda: greedy.allocate([blocks_item("globex", 1, 300)]))
        assert f"holds 40 of the {LEASE_LIMIT} blocks one lease may hold" in e.details
        e = refused(lambda: other.allocate([blocks_item("globex", LEASE_LIMIT + 1, 400)]))
        assert e.reason == status.EXCEEDS_LIMIT
        # Another lease (another tenant's replica) is not starved by the greedy one.
        mine = allocated(other, [blocks_item("globex", 4, 500)])

        stats = greedy.get_stats()
        tenants = {t.tenant: t for t in stats.tenants}
        assert (tenants["acme"].num_sequences, tenants["acme"].num_blocks, tenants["acme"].max_blocks) == (
            3,
            12,
            ACME_QUOTA,
        )
        assert (tenants["globex"].num_blocks, tenants["globex"].max_blocks) == (7 * 4 + 4, 0)
        assert stats.max_blocks_per_lease == LEASE_LIMIT
        port = re.search(r"Prometheus metrics on http://127\.0\.0\.1:(\d+)/", stack.cache.log()).group(1)

        def scraped() -> bool:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            return 'kvtier_cache_tenant_blocks{tenant="acme"} 12.0' in text and (
                'kvtier_cache_tenant_quota_blocks{tenant="acme"} 12.0' in text
            )

        wait_until(scraped, 30, "the per-tenant gauges in the cache's metrics")
        other.free(mine)
        greedy.free(held)
        after = {t.tenant: t for t in greedy.get_stats().tenants}
        assert after["acme"].num_blocks == 0 and "globex" not in after  # no quota, no sequences


def test_a_request_over_its_tenants_quota_fails_at_once_not_after_the_admit_timeout(stack):
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        generate(stack, ACME_KEY, greedy_request([5] * (16 * ACME_QUOTA + 8), 2))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota" in e.value.details() and "can never fit" in e.value.details()
    # The replica was started with --admit-timeout-s 300: this did not wait for it.
    assert time.monotonic() - started < 120
    # The same prompt from a tenant without a quota runs.
    assert len(generate(stack, GLOBEX_KEY, greedy_request([5] * (16 * ACME_QUOTA + 8), 2)).token_ids) == 2


# ------------------------------------------------------------------ in-process


def test_the_api_keys_file_is_checked_and_keys_map_to_their_tenant():
    keys = ApiKeys.parse(KEYS, node_token=TOKEN)
    assert keys.tenant_of(ACME_KEY) == "acme" and keys.tenant_of(GLOBEX_KEY) == "globex"
    assert keys.tenant_of(ACME_KEY + "x") is None and keys.quotas() == {"acme": ACME_QUOTA}
    bad = {
        "duplicate across tenants": {"tenants": {"a": {"keys": [ACME_KEY]}, "b": {"keys": [ACME_KEY]}}},
        "is blank": {"tenants": {"a": {"keys": ["   "]}}},
        "is the node token": {"tenants": {"a": {"keys": [TOKEN]}}},
        "unknown field": {"tenants": {"a": {"keys": [ACME_KEY], "max_block": 3}}},
        "max_blocks": {"tenants": {"a": {"keys": [ACME_KEY], "max_blocks": 0}}},
        "tenant name": {"tenants": {"a b": {"keys": [ACME_KEY]}}},
        "at least 16": {"tenants": {"a": {"keys": ["short"]}}},
        "non-empty": {"tenants": {}},
    }
    for says, doc in bad.items():
        with pytest.raises(ApiKeysError) as e:
            ApiKeys.parse(doc, node_token=TOKEN)
        wanted = "already a key of tenant 'a'" if says == "duplicate across tenants" else says
        assert wanted in str(e.value), (says, str(e.value))
    # Generate's credential: a key admits its tenant; the node token only with --allow-node-token.
    assert ClientKeys(keys).identify(bearer(ACME_KEY)) == "acme"
    assert ClientKeys(keys).identify(bearer(TOKEN)) is None
    assert ClientKeys(keys, node_token=TOKEN).identify(bearer(TOKEN)) == ""
    assert ClientKeys(keys).identify(()) is None


def test_tenant_salts_keep_the_default_tenant_and_separate_the_others():
    assert tenant_salt("", "s") == "s" and tenant_salt("", "") == ""
    salts = {tenant_salt(t, s) for t, s in [("a", "bc"), ("ab", "c"), ("a", ""), ("b", ""), ("a", "b")]}
    assert len(salts) == 5


def test_quota_counts_follow_allocate_extend_swap_and_free():
    bs = 4
    pool = torch.zeros(32, 1, 2, bs, 1, 2)
    table = SequenceTable(
        BlockManager(32, bs),
        HostArea.for_pool(pool.view(32, -1).view(torch.uint8), 16 * pool[0].nbytes),
        model_fingerprint="fp",
        vocab_size=100,
        max_model_len=64,
        tenant_quotas={"a": 6},
        max_blocks_per_lease=10,
    )
    (s1,) = table.allocate("L", [TableItem([1] * 8, tenant="a")])  # 2 blocks
    (s2,) = table.allocate("L", [TableItem([2] * 8, tenant="a")])  # 2 blocks
    table.extend("L", [(s1.sequence_id, 8)])  # +2: a holds 6
    with pytest.raises(ResourceExhausted, match="tenant 'a' holds 6 of its 6-block quota"):
        table.extend("L", [(s2.sequence_id, 1)])
    with pytest.raises(ExceedsLimit, match="can never fit"):
        table.allocate("M", [TableItem([3] * 25, tenant="a")])  # 7 blocks > 6
    table.swap_out("L", [s1.sequence_id])  # the host tier's blocks still count
    with pytest.raises(ResourceExhausted):
        table.allocate("L", [TableItem([4] * 4, tenant="a")])
    table.swap_in("L", [s1.sequence_id])
    (b,) = table.allocate("L", [TableItem([5] * 16, tenant="b")])  # 4 blocks: the lease holds 10
    with pytest.raises(ResourceExhausted, match="--max-blocks-per-lease"):
        table.allocate("L", [TableItem([6] * 4, tenant="b")])
    assert table.limits.tenant_blocks == {"a": 6, "b": 4} and table.limits.lease_blocks == {"L": 10}
    table.check_invariants()
    table.free("L", [s1.sequence_id, s2.sequence_id, b.sequence_id])
    assert table.limits.tenant_blocks == {} and table.limits.lease_blocks == {}
    table.check_invariants()


def test_a_bad_api_keys_file_stops_kvtier_up_and_the_compute_service_at_once(tmp_path):
    env = child_env(tmp_path)
    node_token_as_key = tmp_path / "keys.json"
    node_token_as_key.write_text(json.dumps({"tenants": {"acme": {"keys": [TOKEN]}}}))

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", *argv], env=env, capture_output=True, text=True, timeout=120
        )

    compute = run("computesvc", "--api-keys", str(node_token_as_key))
    assert compute.returncode == 2, compute.stderr
    assert "is the node token" in compute.stderr
    duplicate = tmp_path / "dup.json"
    duplicate.write_text(json.dumps({"tenants": {"a": {"keys": [ACME_KEY]}, "b": {"keys": [ACME_KEY]}}}))
    up = run("kvtier.cli.cli", "up", "--api-keys", str(duplicate))
    assert up.returncode != 0 and "already a key of tenant 'a'" in up.stderr, up.stderr
    assert not (tmp_path / "stack.json").exists() and not list(tmp_path.glob("*.sock"))


# ------------------------------------------------------------------ fair share


def test_a_greedy_tenant_is_refused_its_fair_share_while_another_tenant_gets_in(tmp_path):
    with cache_service(tmp_path, "--num-blocks", "32") as svc, two_leases(svc.address) as (greedy, other):
        # Alone, a tenant may take the whole pool (one tenant: no fair share to keep).
        held = allocated(greedy, [blocks_item("a", 4, k * 10) for k in range(7)])
        e = refused(lambda: other.allocate([blocks_item("b", 8, 500)]))  # 4 free: b waits
        assert "only 4 of 32 blocks are free" in e.details
        # b is waiting: a, holding 28 of 32 blocks, is refused more though 4 are free ...
        e = refused(lambda: greedy.allocate([blocks_item("a", 1, 600)]))
        assert "tenant 'a' holds 28 device blocks, at or over its fair share of 16 blocks" in e.details
        assert "(32 among 2 tenants)" in e.details and "tenant 'b' is waiting" in e.details
        e = refused(lambda: greedy.extend([(held[0], 1)]))
        assert "fair share of 16 blocks" in e.details
        # ... and the refusal changed nothing: the 4 free blocks go to b, under its share.
        mine = allocated(other, [blocks_item("b", 4, 510)])
        e = refused(lambda: other.allocate([blocks_item("b", 8, 520)]))  # none free: b waits
        assert "fair share" not in e.details
        greedy.free(held[:2])  # a finishes two sequences: 8 blocks free
        e = refused(lambda: greedy.allocate([blocks_item("a", 1, 700)]))
        assert "tenant 'a' holds 20 device blocks" in e.details
        mine += allocated(other, [blocks_item("b", 8, 530)])
        tenants = {t.tenant: t.num_blocks for t in other.get_stats().tenants}
        assert tenants == {"a": 20, "b": 12}
        other.free(mine)
        greedy.free(held[2:])


def test_fair_shares_split_the_pool_evenly_with_quotas_as_caps():
    assert fair_shares(32, {"a": 0}) == {"a": 32}
    assert fair_shares(32, {"a": 0, "b": 0}) == {"a": 16, "b": 16}
    assert fair_shares(100, {"a": 10, "b": 0, "c": 0}) == {"a": 10, "b": 45, "c": 45}
    assert fair_shares(100, {"a": 80, "b": 0}) == {"a": 50, "b": 50}  # a quota above the split
    assert fair_shares(100, {"a": 20, "b": 30, "c": 0}) == {"a": 20, "b": 30, "c": 50}
    shares = fair_shares(10, {"a": 0, "b": 0, "c": 0})
    assert sum(shares.values()) == 10 and sorted(shares.values()) == [3, 3, 4]


def fair_table(**kwargs) -> SequenceTable:
    """A 32-block pool of 4-token blocks with a 16-slot host tier, fair share on, reserve 4."""
    pool = torch.zeros(32, 1, 2, 4, 1, 2)
    kwargs.setdefault("fair_share_reserve", 4)
    return SequenceTable(
        BlockManager(32, 4),
        HostArea.for_pool(pool.view(32, -1).view(torch.uint8), 16 * pool[0].nbytes),
        model_fingerprint="fp",
        vocab_size=100,
        max_model_len=64,
        **kwargs,
    )


def grab(table: SequenceTable, lease: str, tenant: str, blocks: int, salt: int) -> int:
    (seq,) = table.allocate(
        lease, [TableItem([salt % 100] * (4 * blocks), tenant_salt=str(salt), tenant=tenant)]
    )
    return seq.sequence_id


def test_fair_share_refuses_only_over_share_tenants_and_only_under_pressure():
    table = fair_table()
    a = [grab(table, "A", "a", 4, k) for k in range(6)]  # a holds 24; 8 free
    b = grab(table, "B", "b", 2, 50)  # b holds 2; 6 free
    # No pressure (a call leaving >= 4 free): a, over its share of 16, still grows.
    a.append(grab(table, "A", "a", 2, 60))  # a 26, 4 free
    # Pressure (the call would leave < 4 free): a is refused, on Allocate and on Extend ...
    with pytest.raises(
        ResourceExhausted,
        match=r"tenant 'a' holds 26 device blocks.*fair share of 16.*4 of 32 blocks are free",
    ):
        grab(table, "A", "a", 2, 70)
    with pytest.raises(ResourceExhausted, match="fair share of 16"):
        table.extend("A", [(a[0], 1)])
    # ... b, under its share, is not: it takes the pool down to 0 free.
    b2 = grab(table, "B", "b", 4, 80)
    assert table.block_manager.num_free_blocks == 0
    table.check_invariants()
    # Swapping a sequence out lowers a's device blocks; swapping it back in under pressure is refused.
    table.swap_out("A", [a[0], a[1]])  # a 18 on the device; 8 free
    with pytest.raises(ResourceExhausted, match="tenant 'a' holds 18 device blocks"):
        table.swap_in("A", [a[0], a[1]])
    assert table.limits.tenant_blocks == {"a": 26, "b": 6}  # both tiers, as quotas count them
    table.free("B", [b, b2])
    table.swap_in("A", [a[0], a[1]])  # b is gone: one tenant, no fair share
    table.check_invariants()


def test_fair_share_off_and_one_tenant_keep_the_old_behaviour():
    for table, tenants in ((fair_table(fair_share=False), ("a", "b")), (fair_table(), ("", ""))):
        first, second = tenants
        held = [grab(table, "A", first, 4, k) for k in range(6)]
        grab(table, "B", second, 2, 50)
        held.append(grab(table, "A", first, 4, 60))  # leaves 2 free: no fair share refuses it
        assert table.block_manager.num_free_blocks == 2 and not table.limits.waiting_tenants
        table.check_invariants()
