"""Routing across two nodes: TTFT, prefix hit rate and per-node share for kv-aware (prefix only),
load-aware kv-aware, round-robin and random routing, in the same run.

Two nodes run as real processes (a cache service with its own pool, standing for one GPU, and a
compute replica each), with a random Llama (hidden 512, 8 layers, byte vocabulary) big enough
that prefill costs something on a CPU. The workload (issue 25): --conversations chats, each
opened on one of --systems system prompts of --system-tokens tokens picked with Zipf popularity
(exponent --zipf), then --turns turns that re-send the whole history (system prompt, earlier
questions and answers) plus a new question of --question-tokens tokens. Chats open as a Poisson
process (open loop, the same times for every policy: a slow policy queues, it does not slow the
arrivals) of --load x 2 / the probe's cold TTFT requests per second (--load 1: the rate two nodes
serve requests that all miss); a chat's turns run one after another. Each pool holds
--pool-share of the system-prompt set (blocks of every system prompt; the requests in flight take
their blocks from it too), so round-robin, which sends every prompt to both nodes, evicts prompts
it will want again, while kv-aware routing partitions the set and each node keeps its part. One
gateway per policy (`python -m gateway --node ... --routing P`), each with its own cache_salt so no
policy reuses another's blocks; the pools are shared, in policy order.

Hit rate comes from usage.cached_tokens, TTFT from the first streamed event, the per-node share
from the gateway's kvtier_gateway_node_requests_total. Before the policies, a probe measures on
the quiet nodes what a hit saves: TTFT of a system prompt + question sent cold, then again.

    python bench/router.py            # 200 chats of 1-3 turns over 24 system prompts
    python bench/router.py --quick    # 40 chats over 12 system prompts

Target (issue 25): load-aware TTFT p50 and p90 both <= 0.6x round-robin's, hit rate >= 1.3x
round-robin's. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BS = 16
MIN_IN_FLIGHT = 4  # prompts a pool must hold at once
# (name in the table, --routing, --routing-load-weight)
POLICIES = (
    ("kv-aware", "kv-aware", 0.0),
    ("load-aware", "kv-aware", 1.0),
    ("round-robin", "round-robin", 1.0),
    ("random", "random", 1.0),
)


@dataclass
class Result:
    ttft_s: float
    cached: int
    prompt: int
    error: str = ""


def zipf_choice(rng: random.Random, n: int, exponent: float) -> int:
    """One of range(n), k drawn with weight 1 / (k + 1) ** exponent."""
    weights = [1 / (k + 1) ** exponent for k in range(n)]
    return rng.choices(range(n), weights)[0]


def workload(args: argparse.Namespace) -> list[list[list[int]]]:
    """The chats: each a list of turns, each turn the whole prompt it sends (token ids)."""
    rng = random.Random(args.seed)
    systems = [[1 + rng.randrange(250) for _ in range(args.system_tokens)] for _ in range(args.systems)]
    chats = []
    for c in range(args.conversations):
        history = list(systems[zipf_choice(rng, args.systems, args.zipf)])
        turns = []
        for t in range(rng.randint(1, args.turns)):
            history += [1 + (c * 13 + t * 7 + k) % 250 for k in range(args.question_tokens)]
            turns.append(list(history))
            # The answer, as the next turn re-sends it (a stand-in for the generated text).
            history += [1 + (c * 5 + t * 11 + k) % 250 for k in range(args.max_tokens)]
        chats.append(turns)
    return chats


async def one(http, url: str, prompt: list[int], max_tokens: int, salt: str) -> Result:
    from bench.http_api import JSON_HEADERS, completion_body

    body = json.dumps(completion_body(prompt, max_tokens, salt)).encode()
    t0 = time.perf_counter()
    ttft = 0.0
    async with http.post(f"{url}/v1/completions", data=body, headers=JSON_HEADERS) as reply:
        if reply.status != 200:
            return Result(0.0, 0, len(prompt), f"HTTP {reply.status}: {(await reply.read())[:200]!r}")
        async for line in reply.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if not ttft:
                ttft = time.perf_counter() - t0
            if b'"error"' in line:
                return Result(ttft, 0, len(prompt), json.loads(line[6:])["error"]["message"])
            if b'"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                return Result(ttft, cached, usage["prompt_tokens"])
    return Result(ttft, 0, len(prompt), "the stream ended without usage")


def chat_starts(args: argparse.Namespace, num_chats: int, chats_per_s: float) -> list[float]:
    """When each chat opens, in seconds from the start: a Poisson process of ``chats_per_s``, the
    same times for every policy (seeded)."""
    rng = random.Random(args.seed + 1)
    return list(itertools.accumulate(rng.expovariate(chats_per_s) for _ in range(num_chats)))


async def run_policy(
    url: str, chats: list[list[list[int]]], args: argparse.Namespace, salt: str, chats_per_s: float
) -> list[Result]:
    """Every chat, opened at ``chat_starts`` (open loop: a slow policy does not slow the arrivals),
    each chat's turns one after another."""
    import aiohttp

    results: list[Result] = []
    loop = asyncio.get_running_loop()

    async def chat(http, start_s: float, turns: list[list[int]]) -> None:
        await asyncio.sleep(max(0.0, start_s - (loop.time() - t0)))
        for prompt in turns:
            results.append(await one(http, url, prompt, args.max_tokens, salt))

    connector = aiohttp.TCPConnector(limit=0)  # as many connections as chats open
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), connector=connector) as http:
        t0 = loop.time()
        starts = chat_starts(args, len(chats), chats_per_s)
        await asyncio.gather(*(chat(http, s, turns) for s, turns in zip(starts, chats, strict=True)))
    return results


def node_shares(url: str) -> dict[str, float]:
    """Each node's share of the requests the gateway at `url` sent (its per-node counter)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    counts = {
        s.labels["node"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvtier_gateway_node_requests_total"
    }
    total = sum(counts.values()) or 1
    return {node: n / total for node, n in sorted(counts.items())}


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", type=int, default=24, help="system prompts")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--zipf", type=float, default=0.5, help="popularity exponent over the system prompts")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=3, help="turns per chat: 1 to this many")
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--load",
        type=float,
        default=1.25,
        help="requests per second offered, in units of 2 / the probe's cold TTFT (the rate two nodes "
        "serve requests that all miss)",
    )
    ap.add_argument(
        "--pool-share", type=float, default=0.6, help="of the system-prompt set's blocks each pool holds"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="local HF model dir (default: a random 8-layer Llama)")
    ap.add_argument("--quick", action="store_true", help="40 chats over 12 system prompts")
    args = ap.parse_args()
    if args.quick:
        args.systems, args.conversations = 12, 40
    return args


def pool_blocks(args: argparse.Namespace) -> int:
    """Blocks per pool: --pool-share of the system-prompt set; it must hold the requests in flight."""
    num_blocks = round(args.pool_share * args.systems * (args.system_tokens // BS))
    longest = args.system_tokens + args.turns * (args.question_tokens + args.max_tokens)
    in_flight = MIN_IN_FLIGHT * -(-longest // BS)
    if num_blocks < in_flight:
        raise SystemExit(
            f"a pool of {num_blocks} blocks cannot hold {MIN_IN_FLIGHT} prompts of {longest} tokens"
        )
    return num_blocks


def start_nodes(args: argparse.Namespace, work: Path, model: str, env: dict) -> list:
    """Two nodes (a cache service and one replica each), serving."""
    from kvtier_cli.stack import LocalStack, up_side_by_side

    num_blocks = pool_blocks(args)
    cache_args = [
        "--model",
        model,
        "--num-blocks",
        str(num_blocks),
        "--swap-space",
        "0",
        "--host-cache-gib",  # the pools alone: no host tier (a service's default keeps a share of memory)
        "0",
        "--log-level",
        "WARNING",
    ]
    compute_args = ["--model", model, "--threads", "1", "--log-level", "WARNING"]
    stacks = [
        LocalStack(work / f"node-{i}", cache_args, compute_args, num_replicas=1, env=env) for i in range(2)
    ]
    up_side_by_side(stacks)
    return stacks


async def probe(url: str, args: argparse.Namespace, rounds: int = 3) -> tuple[float, float]:
    """Median TTFT (ms) of a system prompt + question sent cold, then sent again (a hit), one
    request at a time on the quiet nodes: what a hit saves, without queueing."""
    import aiohttp

    rng = random.Random(-1)
    cold, warm = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for _ in range(rounds):
            prompt = [1 + rng.randrange(250) for _ in range(args.system_tokens + args.question_tokens)]
            for times in (cold, warm):
                r = await one(http, url, prompt, args.max_tokens, "probe")
                if r.error:
                    raise RuntimeError(f"probe: {r.error}")
                times.append(1000 * r.ttft_s)
    return statistics.median(cold), statistics.median(warm)


def measure(args: argparse.Namespace, stacks: list, model: str, env: dict, work: Path) -> dict[str, dict]:
    """Every policy's figures, one gateway after another over the same nodes; the probe's under
    "probe" (before the first policy)."""
    from kvtier_cli.stack import start, wait_gateway

    chats = workload(args)
    nodes = []
    for i, stack in enumerate(stacks):
        nodes += ["--node", f"node-{i}@{stack.cache_address}={','.join(stack.compute_addresses)}"]
    rows: dict[str, dict] = {}
    for k, (name, routing, weight) in enumerate(POLICIES):
        argv = ["--host", "127.0.0.1", "--port", "0", "--model", model, *nodes, "--routing", routing]
        argv += ["--routing-load-weight", str(weight), "--log-level", "WARNING"]
        gateway = wait_gateway(start(f"gateway-{name}", "gateway", argv, "", work, env))
        try:
            if k == 0:
                rows["probe"] = dict(
                    zip(("cold", "warm"), asyncio.run(probe(gateway.address, args)), strict=True)
                )
                requests_per_s = args.load * 2 / (rows["probe"]["cold"] / 1000)
                chats_per_s = requests_per_s * len(chats) / sum(map(len, chats))
                rows["probe"]["requests_per_s"] = requests_per_s
            started = time.perf_counter()
            results = asyncio.run(run_policy(gateway.address, chats, args, f"bench-{k}", chats_per_s))
            wall_s = time.perf_counter() - started
            shares = node_shares(gateway.address)
        finally:
            gateway.stop()
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(f"{name}: {len(errors)} errors, first: {errors[0]}")
        ttfts = [r.ttft_s for r in results]
        rows[name] = {
            "hit": sum(r.cached for r in results) / sum(r.prompt for r in results),
            "p50": 1000 * statistics.median(ttfts),
            "p90": percentile_ms(ttfts, 0.9),
            "shares": shares,
            "requests": len(results),
            "wall_s": wall_s,
        }
    return rows


def sizes(args: argparse.Namespace) -> str:
    """The workload's and the pools' sizes, in tokens and blocks."""
    chats = workload(args)
    prompts = [p for chat in chats for p in chat]
    system_blocks = args.system_tokens // BS
    num_blocks = pool_blocks(args)
    share = num_blocks / (args.systems * system_blocks)
    lengths = [len(p) for p in prompts]
    return (
        f"two nodes of {num_blocks} blocks ({BS} tokens, no host tier) each = {share:.0%} of the {args.systems} system "
        f"prompts of {args.system_tokens} tokens ({system_blocks} blocks each; a pool holds "
        f"{num_blocks // system_blocks} of them), Zipf {args.zipf}; {len(chats)} chats of 1-{args.turns} turns "
        f"= {len(prompts)} requests of {min(lengths)}-{max(lengths)} prompt tokens ({sum(lengths)} in all), "
        f"{args.max_tokens} new tokens each"
    )


def report(args: argparse.Namespace, rows: dict[str, dict]) -> None:
    print(sizes(args))
    probed = rows.pop("probe")
    print(
        f"probe, one request at a time on the quiet nodes: TTFT of "
        f"{args.system_tokens + args.question_tokens} prompt tokens cold {probed['cold']:.1f} ms, cached {probed['warm']:.1f} ms (median of 3); chats "
        f"open as a Poisson process of {probed['requests_per_s']:.2f} requests/s (--load {args.load})"
    )
    print(f"{'routing':>12} {'hit %':>6} {'TTFT p50 ms':>12} {'p90 ms':>8} {'wall s':>7}  share per node")
    for name, r in rows.items():
        shares = " ".join(f"{node} {100 * s:.0f}%" for node, s in r["shares"].items())
        print(
            f"{name:>12} {100 * r['hit']:6.1f} {r['p50']:12.1f} {r['p90']:8.1f} {r['wall_s']:7.1f}  {shares}"
        )
    la, kv, rr = rows["load-aware"], rows["kv-aware"], rows["round-robin"]
    print(
        f"headline: load-aware kv routing: TTFT p50 {la['p50'] / rr['p50']:.2f}x and p90 "
        f"{la['p90'] / rr['p90']:.2f}x round-robin's (target <= 0.6x), hit rate {la['hit'] / rr['hit']:.2f}x "
        f"round-robin's (target >= 1.3x) and {la['hit'] / kv['hit']:.2f}x prefix-only kv-aware's"
    )


def main() -> int:
    args = parse_args()
    from bench.models import random_llama_dir

    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-router-"))
    model = args.model or str(
        random_llama_dir(
            work / "model", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, max_positions=2048
        )
    )
    os.environ["KVTIER_TOKEN"] = "bench-token"
    env = dict(os.environ)
    stacks = []
    try:
        stacks = start_nodes(args, work, model, env)
        rows = measure(args, stacks, model, env, work)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        for stack in stacks:
            stack.down()
    report(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
