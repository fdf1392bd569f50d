"""Routing across two nodes: TTFT, prefix hit rate and per-node share for kv-aware (prefix only),
load-aware kv-aware, round-robin and random routing, in the same run.

Two nodes run as real processes (a cache service with its own pool, standing for one GPU, and a
compute replica each), with a random Llama (hidden 512, 8 layers, byte vocabulary) big enough
that prefill costs something on a CPU. The workload (issue 25): --conversations chats, each
opened on one of --systems system prompts of --system-tokens tokens picked with Zipf popularity
(exponent --zipf), then --turns turns that re-send the whole history (system prompt, earlier
questions and answers) plus a new question of --question-tokens tokens. Chats open as a Poisson
process (open loop, the same times for every policy: a slow policy queues, it does not slow the
arrivals); a chat's turns run one after another. Each pool holds --pool-share of the
system-prompt set (blocks of every system prompt; the requests in flight take their blocks from
it too), so round-robin, which sends every prompt to both nodes, evicts prompts it will want
again, while kv-aware routing partitions the set and each node keeps its part. One gateway per
policy (`python -m kvtier.gateway --node ... --routing P`), each with its own cache_salt so no policy
reuses another's blocks; the pools are shared, in policy order.

The offered load. Each repeat first calibrates the nodes' *capacity*: the requests/s they serve
when every request misses (closed loops of cold system prompt + question requests, two open per
node, the median of three batches; printed), and offers --load x that. A rate measured under
load is steadier than one cold TTFT (it varied 1.7x between runs on this shared machine), and
calibrating per repeat keeps the load a fixed multiple of what the machine gives *now*. --load
2.5 is the regime issue 25 is about, where round-robin's misses queue behind each other:
round-robin hits 57-67% of prompt tokens, so its misses alone offer 0.84-1.10 of the nodes'
all-miss capacity (the "miss load" column; it fell behind the arrivals in 5 of 6 repeats), and
the hits that share their prefill steps wait with them; load-aware routing hits ~88%, a miss
load of ~0.3, and keeps up with the arrivals. Lower,
the comparison measures only that nothing queues: at --load 2 round-robin's misses barely met
(their TTFT median ~600 ms, ~570 alone; p50 ratio 0.60x), and at 1.25 (the earlier default)
round-robin's median request was a cached one, as fast as load-aware's (p50 ratio ~1). Each
repeat runs every policy, their order rotated by one per repeat; the table shows each repeat and
the medians, and the headline is the median of the repeats' ratios.

Hit rate comes from usage.cached_tokens, TTFT from the first streamed event, the per-node share
from the gateway's kvtier_gateway_node_requests_total. Before the first repeat, a probe measures
on the quiet nodes what a hit saves: TTFT of a system prompt + question sent cold, then again.
--dump DIR writes every request's timeline (bench/router_timeline.py: the router's figures at its
decision, TTFT, predicted and actual hits) and prints load-aware's slowest requests.

    python bench/router.py            # 200 chats of 1-3 turns over 24 system prompts, 3 repeats (17 min)
    python bench/router.py --quick    # 40 chats over 12 system prompts

Target (issue 25): load-aware TTFT p50 and p90 both <= 0.6x round-robin's, hit rate >= 1.3x
round-robin's. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from router_client import CALIBRATION_PER_NODE, Result, calibrate, one, probe  # noqa: E402

BS = 16
MIN_IN_FLIGHT = 4  # prompts a pool must hold at once
# name in the table: (--routing, --routing-load-weight)
ROUTING = {
    "kv-aware": ("kv-aware", 0.0),
    "load-aware": ("kv-aware", 1.0),
    "round-robin": ("round-robin", 1.0),
    "random": ("random", 1.0),
}


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

    async def chat(http, c: int, start_s: float, turns: list[list[int]]) -> None:
        await asyncio.sleep(max(0.0, start_s - (loop.time() - t0)))
        for t, prompt in enumerate(turns):
            sent_s = loop.time() - t0
            r = await one(http, url, prompt, args.max_tokens, salt)
            r.chat, r.turn, r.sent_s, r.end_s = c, t, sent_s, loop.time() - t0
            results.append(r)

    connector = aiohttp.TCPConnector(limit=0)  # as many connections as chats open
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), connector=connector) as http:
        t0 = loop.time()
        starts = chat_starts(args, len(chats), chats_per_s)
        await asyncio.gather(
            *(chat(http, c, s, turns) for c, (s, turns) in enumerate(zip(starts, chats, strict=True)))
        )
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
        default=2.5,
        help="requests per second offered, in units of the nodes' calibrated capacity for requests that "
        "all miss (module docstring)",
    )
    ap.add_argument(
        "--pool-share", type=float, default=0.6, help="of the system-prompt set's blocks each pool holds"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="local HF model dir (default: a random 8-layer Llama)")
    ap.add_argument("--repeats", type=int, default=3, help="times every policy runs (their order rotated)")
    ap.add_argument(
        "--dump",
        type=Path,
        help="write each request's timeline (the router's figures at its decision, TTFT, hits) "
        "to DIR/<repeat>-<policy>.jsonl and print load-aware's slowest requests (gateways log at DEBUG)",
    )
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
    from kvtier.cli.stack import LocalStack, up_side_by_side

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


def gateway_argv(model: str, nodes: list[str], routing: str, weight: float, debug: bool) -> list[str]:
    argv = ["--host", "127.0.0.1", "--port", "0", "--model", model, *nodes, "--routing", routing]
    return argv + ["--routing-load-weight", str(weight), "--log-level", "DEBUG" if debug else "WARNING"]


def summary(results: list[Result], shares: dict[str, float], wall_s: float) -> dict:
    """One policy's figures from its requests (TTFT in ms)."""
    ttfts = [r.ttft_s for r in results]
    return {
        "hit": sum(r.cached for r in results) / sum(r.prompt for r in results),
        "p50": 1000 * statistics.median(ttfts),
        "p90": percentile_ms(ttfts, 0.9),
        "shares": shares,
        "miss_tokens": sum(r.prompt - r.cached for r in results) / len(results),
        "wall_s": wall_s,
    }


def calibrated_rate(
    args: argparse.Namespace, model: str, nodes: list[str], env: dict, work: Path, out: dict
) -> float:
    """Calibrate the nodes' capacity now (and, the first time, probe what a hit saves) through a
    gateway of its own; record it in ``out`` and return the requests/s to offer."""
    from kvtier.cli.stack import start, wait_gateway

    argv = gateway_argv(model, nodes, "kv-aware", 0.0, False)
    gateway = wait_gateway(start(f"gateway-calibrate-{len(out['repeats'])}", "gateway", argv, "", work, env))
    try:
        if "probe" not in out:
            out["probe"] = asyncio.run(probe(gateway.address, args))
        calibration = asyncio.run(calibrate(gateway.address, args))
    finally:
        gateway.stop()
    out["calibrations"].append(calibration)
    return args.load * statistics.median(calibration)


def measure(args: argparse.Namespace, stacks: list, model: str, env: dict, work: Path) -> dict:
    """--repeats times: calibrate the capacity, then every policy at --load x it, one gateway after
    another over the same nodes, the policies' order rotated by one each repeat (the machine's
    drift does not favour one). Returns {"probe": (cold, warm ms), "calibrations": [[req/s]],
    "rates": [req/s offered], "repeats": [{policy: figures}]}."""
    import router_timeline

    from kvtier.cli.stack import start, wait_gateway

    chats = workload(args)
    nodes = []
    for i, stack in enumerate(stacks):
        nodes += ["--node", f"node-{i}@{stack.cache_address}={','.join(stack.compute_addresses)}"]
    out: dict = {"repeats": [], "calibrations": [], "rates": []}
    for rep in range(args.repeats):
        requests_per_s = calibrated_rate(args, model, nodes, env, work, out)
        out["rates"].append(requests_per_s)
        chats_per_s = requests_per_s * len(chats) / sum(map(len, chats))
        rows: dict[str, dict] = {}
        for name in rows_order(rep):
            routing, weight = ROUTING[name]
            argv = gateway_argv(model, nodes, routing, weight, args.dump is not None)
            gateway = wait_gateway(start(f"gateway-{rep}-{name}", "gateway", argv, "", work, env))
            try:
                started = time.perf_counter()
                results = asyncio.run(
                    run_policy(gateway.address, chats, args, f"bench-{rep}-{name}", chats_per_s)
                )
                wall_s = time.perf_counter() - started
                shares = node_shares(gateway.address)
            finally:
                gateway.stop()
            errors = [r.error for r in results if r.error]
            if errors:
                raise RuntimeError(f"{name}: {len(errors)} errors, first: {errors[0]}")
            rows[name] = summary(results, shares, wall_s)
            if args.dump is not None:
                timeline = router_timeline.timeline(results, router_timeline.parse_routes(gateway.log()))
                router_timeline.write(args.dump / f"{rep}-{name}.jsonl", timeline)
                rows[name]["slowest"] = router_timeline.slowest(timeline)
        out["repeats"].append({name: rows[name] for name in ROUTING})
    return out


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


def ratios(rows: dict[str, dict]) -> tuple[float, float, float]:
    """Load-aware / round-robin TTFT p50, p90 and hit rate."""
    la, rr = rows["load-aware"], rows["round-robin"]
    return la["p50"] / rr["p50"], la["p90"] / rr["p90"], la["hit"] / rr["hit"]


def table(rows: dict[str, dict], miss_load: float) -> None:
    """One repeat's (or the median's) figures per policy. ``miss_load``: converts a policy's
    uncached prompt tokens per request into the prefill load it offers (module docstring)."""
    print(
        f"{'routing':>12} {'hit %':>6} {'TTFT p50 ms':>12} {'p90 ms':>8} {'miss load':>9} {'wall s':>7}  share per node"
    )
    for name, r in rows.items():
        shares = " ".join(f"{node} {100 * s:.0f}%" for node, s in r["shares"].items())
        print(
            f"{name:>12} {100 * r['hit']:6.1f} {r['p50']:12.1f} {r['p90']:8.1f} {miss_load * r['miss_tokens']:9.2f} "
            f"{r['wall_s']:7.1f}  {shares}"
        )
        for line in r.get("slowest", []) if name == "load-aware" else []:
            print(line)
    p50, p90, hit = ratios(rows)
    print(f"  load-aware / round-robin: p50 {p50:.2f}x, p90 {p90:.2f}x, hit {hit:.2f}x")


def report(args: argparse.Namespace, out: dict, run_s: float) -> None:
    print(sizes(args))
    cold, warm = out["probe"]
    cold_tokens = args.system_tokens + args.question_tokens
    print(
        f"probe, one request at a time on the quiet nodes: TTFT of {cold_tokens} prompt tokens cold "
        f"{cold:.1f} ms, cached {warm:.1f} ms (median of 3)"
    )
    for rep, rows in enumerate(out["repeats"]):
        calibration, rate = out["calibrations"][rep], out["rates"][rep]
        print(
            f"repeat {rep + 1} of {args.repeats}: capacity for requests that all miss ({cold_tokens} prompt "
            f"tokens, {CALIBRATION_PER_NODE} open per node) {' '.join(f'{c:.2f}' for c in calibration)} "
            f"requests/s, median {statistics.median(calibration):.2f}; chats open as a Poisson process of "
            f"{rate:.2f} requests/s (--load {args.load} x the median); policies in the order run: "
            f"{', '.join(rows_order(rep))}"
        )
        # A policy's miss load: the uncached prompt tokens it offers per second over what the
        # nodes prefill per second of all-miss work (1.0: its misses alone fill both nodes), =
        # --load x its uncached tokens per request / a cold request's.
        table(rows, args.load / cold_tokens)
    medians = {
        name: {
            key: statistics.median(rows[name][key] for rows in out["repeats"])
            for key in ("hit", "p50", "p90", "miss_tokens", "wall_s")
        }
        | {"shares": out["repeats"][-1][name]["shares"]}
        for name in ROUTING
    }
    print(f"median of {args.repeats} repeats (shares: the last repeat's; miss load at --load {args.load})")
    table(medians, args.load / cold_tokens)
    p50, p90, hit = (statistics.median(r) for r in zip(*map(ratios, out["repeats"]), strict=True))
    kv = statistics.median(rows["load-aware"]["hit"] / rows["kv-aware"]["hit"] for rows in out["repeats"])
    print(f"run time {run_s / 60:.1f} min")
    print(
        f"headline (median over {args.repeats} repeats of each repeat's ratio): load-aware kv routing: TTFT p50 "
        f"{p50:.2f}x and p90 {p90:.2f}x round-robin's (target <= 0.6x), hit rate {hit:.2f}x round-robin's "
        f"(target >= 1.3x) and {kv:.2f}x prefix-only kv-aware's"
    )


def rows_order(rep: int) -> list[str]:
    """The policies in the order repeat ``rep`` runs them: rotated by one per repeat."""
    names = list(ROUTING)
    return names[rep % len(names) :] + names[: rep % len(names)]


def main() -> int:
    args = parse_args()
    from models import random_llama_dir

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-router-"))
    model = args.model or str(
        random_llama_dir(
            work / "model", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, max_positions=2048
        )
    )
    os.environ["KVTIER_TOKEN"] = "bench-token"
    env = dict(os.environ)
    if args.dump is not None:
        args.dump.mkdir(parents=True, exist_ok=True)
    stacks = []
    try:
        stacks = start_nodes(args, work, model, env)
        out = measure(args, stacks, model, env, work)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        for stack in stacks:
            stack.down()
    report(args, out, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
