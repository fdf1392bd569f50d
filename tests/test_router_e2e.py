"""Two nodes behind the gateway's router, end to end: real cache services (one pool each, standing
for two GPUs), a compute replica per node, gateways with --routing kv-aware and round-robin, and
the official `openai` client. Counted tokens, not timings."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import REPO, cache_stats, child_env, wait_until

from kvtier.cli.stack import LocalStack, start, up_side_by_side, wait_gateway
from kvtier.model_spec import TINY_LLAMA_CONFIG

BS = 16
SYSTEM_LEN = 6 * BS  # six full blocks per system prompt
NUM_SYSTEMS = 16
QUESTIONS = 4
BOS = TINY_LLAMA_CONFIG["bos_token_id"]
# Each pool holds about half of the system prompts (8 x 6 blocks) plus a request in flight.
NODE_ARGS = ["--num-blocks", "64", "--lease-ttl", "2", "--host-cache-gib", "0"]  # device-only hits


def system_prompt(s: int) -> list[int]:
    return [BOS, *[1 + (s * 53 + 7 * k) % 250 for k in range(SYSTEM_LEN - 1)]]


def question(s: int, q: int) -> list[int]:
    return [1 + (s * 11 + q * 29 + 3 * k) % 250 for k in range(BS)]


def workload(seed: int) -> list[tuple[int, int]]:
    """(system, question) pairs: QUESTIONS rounds, each visiting every system in a shuffled order."""
    rng = random.Random(seed)
    order = []
    for q in range(QUESTIONS):
        systems = list(range(NUM_SYSTEMS))
        rng.shuffle(systems)
        order += [(s, q) for s in systems]
    return order


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    base = tmp_path_factory.mktemp("nodes")
    stacks = [
        LocalStack(base / f"node-{i}", NODE_ARGS, [], num_replicas=1, env=child_env(base / f"node-{i}"))
        for i in range(2)
    ]
    try:
        up_side_by_side(stacks)  # both nodes start at once
        yield stacks
    finally:
        for stack in stacks:
            stack.down()


def node_flags(stacks: list[LocalStack]) -> list[str]:
    flags = []
    for i, stack in enumerate(stacks):
        flags += ["--node", f"node-{i}@{stack.cache_address}={','.join(stack.compute_addresses)}"]
    return flags


@pytest.fixture(scope="module")
def gateways(nodes, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gateways")
    procs = {}
    try:
        for routing in ("kv-aware", "round-robin"):
            argv = ["--host", "127.0.0.1", "--port", "0", *node_flags(nodes), "--routing", routing]
            procs[routing] = start(
                f"gateway-{routing}", "gateway", argv, "", run_dir, child_env(nodes[0].run_dir)
            )
        for proc in procs.values():
            wait_gateway(proc)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def run_workload(url: str, salt: str, seed: int = 0) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) over the workload, one request at a time."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    cached = total = 0
    for s, q in workload(seed):
        reply = client.completions.create(
            model="kvtier-tiny",
            prompt=system_prompt(s) + question(s, q),
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt, "ignore_eos": True},
        )
        cached += reply.usage.prompt_tokens_details.cached_tokens
        total += reply.usage.prompt_tokens
    return cached, total


def test_kv_aware_routing_hits_like_one_big_node_and_beats_round_robin(gateways) -> None:
    # The most any placement can hit: every request after a system's first hits its whole prompt.
    ideal = NUM_SYSTEMS * (QUESTIONS - 1) * SYSTEM_LEN
    kv, total = run_workload(gateways["kv-aware"].address, "run-kv")
    rr, _ = run_workload(gateways["round-robin"].address, "run-rr")
    print(
        f"cached prompt tokens of {total}: kv-aware {kv}, round-robin {rr}, ideal (one pool holding all) {ideal}"
    )
    assert kv >= 0.9 * ideal, f"kv-aware hit {kv} tokens, under 0.9 x the one-big-pool {ideal}"
    assert kv >= 1.5 * rr, f"kv-aware {kv} is not 1.5 x round-robin {rr}"
    metrics = httpx.get(f"{gateways['kv-aware'].address}/metrics", timeout=30).text
    assert 'kvtier_router_decisions_total{reason="prefix"}' in metrics
    values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    predicted = values["kvtier_router_predicted_cached_tokens_total"]
    actual = values["kvtier_router_actual_cached_tokens_total"]
    assert actual == kv and abs(predicted - actual) <= 0.05 * actual, (predicted, actual)


def test_a_hot_prefix_spills_to_the_other_node_when_its_node_is_loaded(gateways) -> None:
    """Requests for one system prompt, all at once: the node that caches it takes them until the
    work queued there costs more than the prefill it saves; the rest spill to the other node,
    which then caches the prompt too. Per-node series show where they went."""
    url = gateways["kv-aware"].address
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    hot = system_prompt(NUM_SYSTEMS + 1)

    def ask(q: int):
        return client.completions.create(
            model="kvtier-tiny",
            prompt=hot + question(NUM_SYSTEMS + 1, q),
            max_tokens=24,
            temperature=0,
            extra_body={"cache_salt": "spill", "ignore_eos": True},
        )

    before = scrape(url)
    ask(0)  # caches the prompt on one node
    with ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(ask, range(1, 13)))
    assert all(r.usage.completion_tokens == 24 for r in replies)
    after = scrape(url)
    spills = (
        after[("kvtier_router_decisions_total", "load_spill")]
        - before[("kvtier_router_decisions_total", "load_spill")]
    )
    served = {
        node: after[("kvtier_gateway_node_requests_total", node)]
        - before.get(("kvtier_gateway_node_requests_total", node), 0)
        for node in ("node-0", "node-1")
    }
    print(f"13 requests for one prompt: {served} per node, {spills:.0f} spilled")
    assert spills > 0 and min(served.values()) > 0, (served, spills)
    assert sum(served.values()) == 13
    assert after[("kvtier_gateway_node_up", "node-0")] == after[("kvtier_gateway_node_up", "node-1")] == 1
    # The node the prompt spilled to cached it too: both now predict (and get) a hit.
    assert ask(13).usage.prompt_tokens_details.cached_tokens >= SYSTEM_LEN


def scrape(url: str) -> dict[tuple[str, str], float]:
    """The gateway's samples by (name, the value of its reason or node label)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (s.name, s.labels.get("reason") or s.labels.get("node") or ""): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_a_killed_cache_service_sends_requests_to_the_other_node_until_it_is_back(nodes, gateways) -> None:
    url = gateways["round-robin"].address
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(k: int) -> str:
        return (
            client.completions.create(
                model="kvtier-tiny", prompt=system_prompt(k)[:20], max_tokens=2, temperature=0
            )
            .choices[0]
            .text
        )

    nodes[0].cache.stop(signal.SIGKILL)
    try:
        # The gateway keeps serving: a request routed to the dead node fails over to the other.
        for k in range(6):
            ask(k)
        assert (
            "routing around it" in gateways["round-robin"].log()
            or "trying the next node" in gateways["round-robin"].log()
        )
        # Counted whichever way it was found out (a failed request or a failed GetStats).
        assert scrape(url)[("kvtier_router_decisions_total", "node_down")] > 0
    finally:
        nodes[0].start_cache()
    # Back: node 0's replica re-attaches, the router sees it answer and gives it traffic again.
    before = node0_requests(nodes[0])
    wait_until(lambda: (ask(99), node0_requests(nodes[0]) > before)[1], 90.0, "node 0 serving again")


def test_a_stream_cut_by_its_nodes_cache_service_says_so(nodes, gateways) -> None:
    """SIGKILL the cache service of the node a stream is on: the stream ends with an error event
    that names the cause (that node's cache service went away) and says to retry; a new request
    goes to the other node at once."""
    url = gateways["round-robin"].address
    body = {"prompt": [BOS, 9, 8, 7], "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
        lines = reply.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        in_flight = scrape(url)
        (k,) = [
            i for i in range(2) if in_flight[("kvtier_gateway_node_requests_in_flight", f"node-{i}")] == 1
        ]
        nodes[k].cache.stop(signal.SIGKILL)
        try:
            events += [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]", events[-3:]
            error = json.loads(events[-2][6:])["error"]
            assert "cache service went away" in error["message"] and "retry" in error["message"], error
            assert error["type"] == "service_unavailable_error", error
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            for q in range(2):  # round-robin: one of them is routed to the dead node first
                assert client.completions.create(model="kvtier-tiny", prompt=[BOS, q], max_tokens=2).usage
        finally:
            nodes[k].start_cache()
            wait_until(lambda: cache_stats(nodes[k]).leases, 90.0, f"node {k}'s replica re-attached")


def node0_requests(stack: LocalStack) -> int:
    """Prompt tokens node 0's (new) cache service has looked up: grows when it serves a request."""
    return cache_stats(stack).prefix_query_tokens


def test_an_unreachable_node_at_start_is_logged_and_routed_around(nodes, tmp_path) -> None:
    dead = f"unix://{tmp_path / 'nothing-here.sock'}"
    argv = ["--host", "127.0.0.1", "--port", "0", *node_flags(nodes[:1]), "--node", f"ghost@{dead}={dead}"]
    gateway = start("gateway-ghost", "gateway", argv, "", tmp_path, child_env(nodes[0].run_dir))
    try:
        wait_gateway(gateway, ready_path="/version")
        client = openai.OpenAI(base_url=f"{gateway.address}/v1", api_key="unused", max_retries=0, timeout=120)
        for k in range(4):
            reply = client.completions.create(
                model="kvtier-tiny", prompt=[BOS, 5, k], max_tokens=2, temperature=0
            )
            assert reply.usage.completion_tokens == 2
        wait_until(lambda: "node ghost does not answer" in gateway.log(), 30.0, "the unreachable node logged")
    finally:
        gateway.stop()


def test_a_malformed_node_file_is_a_clear_error_and_an_unreachable_node_is_not_fatal(tmp_path) -> None:
    bad = tmp_path / "nodes.json"
    bad.write_text(json.dumps({"nodes": [{"name": "a", "cache": "unix:///nowhere.sock"}]}))
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.gateway", "--node-file", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and 'needs "compute"' in out.stderr, out.stderr
