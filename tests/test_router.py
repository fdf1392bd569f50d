"""The KV-aware router (gateway/router.py) against real cache services: its per-node index follows
the WatchEvents streams and agrees with LookupPrefix; it ranks nodes by held prefix and load; it
routes around a node that stops answering and resyncs when it comes back."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from servers import TOKEN, ModuleLoop, cache_service, child_env, tls_cache_service, wait_until_async

from kvtier.cache_client import AllocateItem, CacheClient
from kvtier.cli.stack import LocalStack, start, wait_gateway
from kvtier.gateway.router import Node, NodeFileError, Router, load_node_file, parse_node_flag
from kvtier.model_spec import ModelShape

BS = 16
LOOP = ModuleLoop()
run = LOOP.run
FINGERPRINT = ModelShape.tiny().fingerprint


def prompt(system: int, question: int, system_len: int = 64) -> list[int]:
    return [1 + (system * 31 + k) % 250 for k in range(system_len)] + [
        (question * 7 + k) % 250 for k in range(20)
    ]


def commit(client: CacheClient, token_ids: list[int], tenant_salt: str = "") -> int:
    """Allocate and commit a whole prompt (as a replica does after prefill); returns the sequence id."""
    (seq,) = client.allocate([AllocateItem(token_ids, tenant_salt=tenant_salt)])
    client.commit([(seq.sequence_id, [], len(token_ids))])
    return seq.sequence_id


@pytest.fixture(scope="module")
def two_caches(tmp_path_factory):
    with (
        cache_service(tmp_path_factory.mktemp("node0"), "--num-blocks", "64", "--lease-ttl", "30") as a,
        cache_service(tmp_path_factory.mktemp("node1"), "--num-blocks", "64", "--lease-ttl", "30") as b,
    ):
        yield a, b


def lease(address: str) -> CacheClient:
    client = CacheClient.connect(address, TOKEN, timeout_s=10.0)
    client.attach("router-test-writer", FINGERPRINT)
    return client


async def synced_router(nodes: list[Node], policy: str = "kv-aware") -> Router:
    router = Router(nodes, TOKEN, FINGERPRINT, policy=policy)
    await router.start()
    await router.wait_synced(30.0)
    return router


def test_node_flags_and_files_parse_and_bad_ones_say_what_to_fix(tmp_path) -> None:
    assert parse_node_flag("gpu0@unix:///a/cache.sock=unix:///a/c0.sock,unix:///a/c1.sock", 0) == Node(
        "gpu0", "unix:///a/cache.sock", ["unix:///a/c0.sock", "unix:///a/c1.sock"]
    )
    assert parse_node_flag("10.0.0.1:50051=10.0.0.1:50052", 3).name == "node-3"
    with pytest.raises(NodeFileError, match="expected \\[NAME@\\]CACHE_ADDRESS=COMPUTE_ADDRESS"):
        parse_node_flag("unix:///a/cache.sock", 0)
    good = tmp_path / "nodes.json"
    good.write_text(json.dumps({"nodes": [{"name": "a", "cache": "x:1", "compute": ["x:2"]}]}))
    assert load_node_file(good) == [Node("a", "x:1", ["x:2"])]
    for text, message in (
        ("{", "not JSON"),
        ('{"nodes": []}', 'expected {"nodes"'),
        ('{"nodes": [{"cache": "x:1"}]}', 'needs "compute"'),
        (
            '{"nodes": [{"cache": "x:1", "compute": ["y"]}, {"name": "node-0", "cache": "z", "compute": ["w"]}]}',
            "repeat",
        ),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(NodeFileError, match=message):
            load_node_file(bad)
    with pytest.raises(NodeFileError, match="No such file"):
        load_node_file(tmp_path / "missing.json")


def test_the_index_follows_events_and_equals_lookup_prefix_on_each_node(two_caches) -> None:
    a, b = two_caches
    writers = [lease(a.address), lease(b.address)]
    nodes = [Node("n0", a.address, ["unused"]), Node("n1", b.address, ["unused"])]

    async def check() -> None:
        router = await synced_router(nodes)
        try:
            held = []
            for system in range(6):  # systems 0, 2, 4 on node 0; 1, 3, 5 on node 1
                held.append(commit(writers[system % 2], prompt(system, 0)))
            commit(writers[0], prompt(9, 0), tenant_salt="tenant-salt")
            # Fill node 0 past its pool so some of its blocks are evicted (BlockRemoved).
            writers[0].free(held[0::2])
            for system in range(10, 13):
                commit(writers[0], prompt(system, 0, system_len=240))

            def agrees() -> bool:
                for state, writer in zip(router.states, writers, strict=True):
                    for system in (*range(6), 9, 10, 11, 12):
                        for salt in ("", "tenant-salt"):
                            p = prompt(system, 1)
                            got = router.predicted_tokens(state, router.block_hashes(p, salt, "", BS), len(p))
                            [hit] = writer.lookup_prefix([p], tenant_salt=salt)
                            # The device's run, then what the media below it hold (the host cache: default).
                            want = hit.total
                            if got != min(want, (len(p) - 1) // BS * BS):
                                return False
                return True

            await wait_until_async(
                agrees, 30.0, "the router's index to agree with LookupPrefix on both nodes"
            )
            assert writers[0].get_stats().num_evictions > 0, "node 0 was meant to evict"
            # Systems 1, 3, 5 are on node 1 only; 2 and 4 were evicted from node 0 or are still there.
            route = await router.route(prompt(3, 7))
            assert route.nodes[0].name == "n1" and route.reason == "prefix"
            assert route.predicted_tokens[0] == 64
        finally:
            await router.close()

    try:
        run(check())
    finally:
        for w in writers:
            w.close()


def test_kv_aware_prefers_the_held_prefix_until_the_load_term_outweighs_it(two_caches) -> None:
    a, b = two_caches
    writer = lease(a.address)
    nodes = [Node("n0", a.address, ["unused"]), Node("n1", b.address, ["unused"])]

    async def check() -> None:
        router = await synced_router(nodes)
        try:
            commit(writer, prompt(40, 0))
            p = prompt(40, 1)
            await wait_until_async(lambda: predicted(router, 0, p) == 64, 30.0, "the commit's events")
            assert (await router.route(p)).nodes[0].name == "n0"
            # Work queued on node 0 pushes the next requests to node 1 once it costs more than
            # the prefill the hit saves (both nodes at the same, unmeasured throughput).
            queued = [router.opened(router.states[0], 64, len(p) + 16)]  # 36 tokens of work
            assert (await router.route(p)).nodes[0].name == "n0"
            queued += [router.opened(router.states[0], 64, len(p) + 16) for _ in range(39)]
            route = await router.route(p)
            assert route.nodes[0].name == "n1" and route.reason == "load_spill"
            for on_node in queued:
                on_node.closed(None)
            assert router.states[0].load.outstanding_tokens == 0 and router.states[0].inflight == 0
            # No hit anywhere: the least loaded node, then round-robin between equals.
            router.states[1].inflight = 1
            assert (await router.route(prompt(41, 0))).nodes[0].name == "n0"
            router.states[1].inflight = 0
            firsts = {(await router.route(prompt(42 + k, 0))).nodes[0].name for k in range(4)}
            assert firsts == {"n0", "n1"}
        finally:
            await router.close()

    try:
        run(check())
    finally:
        writer.close()


def predicted(router: Router, node: int, p: list[int]) -> int:
    return router.predicted_tokens(router.states[node], router.block_hashes(p, "", "", BS), len(p))


def test_a_node_that_stops_answering_is_routed_around_and_resynced_when_back(tmp_path) -> None:
    args = ["--num-blocks", "64", "--lease-ttl", "30"]
    stacks = [
        LocalStack(tmp_path / f"n{i}", args, num_replicas=0, env=child_env(tmp_path / f"n{i}"))
        for i in range(2)
    ]
    try:
        for stack in stacks:
            stack.start_cache()
        nodes = [Node(f"n{i}", s.cache_address, ["unused"]) for i, s in enumerate(stacks)]

        async def check() -> None:
            router = await synced_router(nodes, policy="round-robin")
            n0 = router.states[0]
            try:
                stacks[0].cache.stop()
                await wait_until_async(lambda: not n0.up(time.monotonic()), 30.0, "node 0 marked down")
                for _ in range(4):
                    assert (await router.route(prompt(1, 0))).nodes[0].name == "n1"
                stacks[0].start_cache()
                answering = time.monotonic()
                # Back: its stream is reopened from 0 (a new, empty cache) and it gets traffic again.
                await wait_until_async(lambda: n0.up(time.monotonic()) and n0.synced, 40.0, "node 0 back")
                # A timing, not asserted (issue 25's target: within 2 s; reconnect backoff <= 1 s).
                print(f"node 0 back in routing {time.monotonic() - answering:.2f}s after its cache answered")
                firsts = {(await router.route(prompt(1, 0))).nodes[0].name for _ in range(4)}
                assert firsts == {"n0", "n1"}
                writer = lease(stacks[0].cache_address)
                try:
                    commit(writer, prompt(5, 0))
                    await wait_until_async(
                        lambda: predicted(router, 0, prompt(5, 1)) == 64, 30.0, "the new events"
                    )
                finally:
                    writer.close()
            finally:
                await router.close()

        run(check())
    finally:
        for stack in stacks:
            stack.down()


def test_dns_discovery_gives_each_node_the_replicas_its_cache_holds_leases_for(two_caches) -> None:
    """--nodes-dns: every replica is a candidate for every node until the node's GetStats shows
    which of them hold leases there (a replica attaches with its address as its name)."""
    a, b = two_caches
    candidates = ["10.0.0.1:50052", "10.0.0.2:50052"]
    nodes = [
        Node("n0", a.address, list(candidates), candidates=list(candidates)),
        Node("n1", b.address, list(candidates), candidates=list(candidates)),
    ]
    replicas = [CacheClient.connect(x.address, TOKEN, timeout_s=10.0) for x in (a, b)]
    for client, name in zip(replicas, candidates, strict=True):
        client.attach(name, FINGERPRINT)

    async def check() -> None:
        router = await synced_router(nodes)
        try:
            await wait_until_async(
                lambda: [s.node.compute for s in router.states] == [[candidates[0]], [candidates[1]]],
                30.0,
                "each node's replicas from its leases",
            )
        finally:
            await router.close()

    try:
        run(check())
    finally:
        for client in replicas:
            client.close()


def test_dns_rediscovery_adds_and_drops_nodes_as_pods_come_and_go(two_caches) -> None:
    """What each DNS pass does (Router.set_dns_nodes): a new cache pod becomes a node that is
    followed at once, a gone one is dropped; with none, a request gets a clear 'no node' error."""
    a, b = two_caches
    from kvtier.gateway.router import NoNode

    async def check() -> None:
        router = Router([], TOKEN, FINGERPRINT, dns=("unused:1", "unused:2"))
        await router.start()  # its DNS task fails to resolve "unused" and keeps retrying
        try:
            with pytest.raises(NoNode, match="no node is known yet"):
                await router.route(prompt(1, 0))
            await router.set_dns_nodes([a.address], ["r0"])
            await router.set_dns_nodes([a.address, b.address], ["r0", "r1"])
            await router.wait_synced(30.0)
            assert [s.node.cache for s in router.states] == [a.address, b.address]
            assert all(s.node.candidates == ["r0", "r1"] for s in router.states)
            await router.set_dns_nodes([b.address], ["r1"])
            assert [s.node.cache for s in router.states] == [b.address]
            assert router.states[0].node.compute == ["r1"]
        finally:
            await router.close()

    run(check())


def test_a_gateway_whose_dns_finds_nothing_yet_starts_and_answers_503(tmp_path) -> None:
    """No ready pod at start (the name does not resolve) is not fatal: the gateway serves
    /version, says 503 with a reason for completions, and keeps resolving."""
    argv = [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--nodes-dns",
        "no-such-host.invalid:50051,no-such-host.invalid:50052",
    ]
    gateway = start("gateway-dns", "gateway", argv, "", tmp_path, child_env(tmp_path))
    try:
        wait_gateway(gateway, ready_path="/version")
        assert httpx.get(f"{gateway.address}/health", timeout=30).status_code == 503
        reply = httpx.post(
            f"{gateway.address}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30
        )
        assert reply.status_code == 503 and "no node is known yet" in reply.json()["error"]["message"]
        assert "cannot resolve no-such-host.invalid" in gateway.log()
    finally:
        gateway.stop()


def test_the_router_reads_a_tls_cache_with_the_ca_it_is_given(tmp_path) -> None:
    """Router(tls_ca=...) (the gateway's --cache-tls-ca) follows a cache service that serves TLS,
    through kvtier.cache_client as every client does; a router without the CA cannot."""
    with tls_cache_service(tmp_path, "--num-blocks", "8") as (address, cert, _):

        async def check() -> None:
            router = Router([Node("tls", address, ["unused"])], TOKEN, FINGERPRINT, tls_ca=str(cert))
            plain = Router([Node("plain", address, ["unused"])], TOKEN, FINGERPRINT)
            await router.start()
            await plain.start()
            try:
                await router.wait_synced(30.0)
                assert router.states[0].block_size == BS
                await wait_until_async(
                    lambda: not plain.states[0].up(time.monotonic()), 30.0, "the plaintext router to fail"
                )
                assert plain.states[0].block_size == 0
            finally:
                await router.close()
                await plain.close()

        run(check())
