"""KV-aware routing across two nodes: prefix hit rate, TTFT and throughput against round-robin
and random routing, in the same run.

Two nodes run as real processes (a cache service with its own pool, standing for one GPU, and a
compute replica each), with a random Llama (hidden 512, 8 layers, byte vocabulary) big enough
that prefill costs something on a CPU. Each pool holds about half of the workload's system
prompts. The workload: --systems system prompts of --system-tokens tokens, each asked
--questions questions (--question-tokens tokens, --max-tokens new tokens), in rounds that visit
every system in a shuffled order; --concurrency requests in flight. One gateway per policy
(`python -m gateway --node ... --routing P`), each with its own cache_salt so no policy reuses
another's blocks. Hit rate comes from usage.cached_tokens, TTFT from the first streamed event.

    python bench/router.py            # 8 systems x 4 questions per policy
    python bench/router.py --quick    # 6 systems x 3 questions

Target (issue 11): TTFT p50 of round-robin / kv-aware >= 2. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
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
POLICIES = ("kv-aware", "round-robin", "random")


@dataclass
class Result:
    ttft_s: float
    tokens: int
    cached: int
    prompt: int
    error: str = ""


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [[1 + rng.randrange(250) for _ in range(args.system_tokens)] for _ in range(args.systems)]
    prompts = []
    for q in range(args.questions):
        order = list(range(args.systems))
        rng.shuffle(order)
        prompts += [
            systems[s] + [1 + (s * 13 + q * 7 + k) % 250 for k in range(args.question_tokens)] for s in order
        ]
    return prompts


async def one(http, url: str, prompt: list[int], max_tokens: int, salt: str) -> Result:
    from bench.http_api import completion_body

    body = completion_body(prompt, max_tokens, salt)
    t0 = time.perf_counter()
    ttft = 0.0
    async with http.post(f"{url}/v1/completions", json=body) as reply:
        if reply.status != 200:
            return Result(0.0, 0, 0, len(prompt), f"HTTP {reply.status}: {(await reply.read())[:200]!r}")
        async for line in reply.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if not ttft:
                ttft = time.perf_counter() - t0
            if b'"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
                details = usage.get("prompt_tokens_details") or {}
                return Result(
                    ttft, usage["completion_tokens"], details.get("cached_tokens", 0), usage["prompt_tokens"]
                )
    return Result(ttft, 0, 0, len(prompt), "the stream ended without usage")


async def run_policy(
    url: str, prompts: list[list[int]], args: argparse.Namespace, salt: str
) -> tuple[list[Result], float]:
    import aiohttp

    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    gate = asyncio.Semaphore(args.concurrency)

    async def limited(p: list[int]) -> Result:
        async with gate:
            return await one(http, url, p, args.max_tokens, salt)

    try:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return list(results), time.perf_counter() - t0
    finally:
        await http.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="local HF model dir (default: a random 8-layer Llama)")
    ap.add_argument("--quick", action="store_true", help="6 systems x 3 questions")
    args = ap.parse_args()
    if args.quick:
        args.systems, args.questions = 6, 3

    from bench.models import random_llama_dir
    from kvtier_cli.stack import LocalStack, start, wait_gateway

    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-router-"))
    model = args.model or str(
        random_llama_dir(
            work / "model", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, max_positions=2048
        )
    )
    os.environ["KVTIER_TOKEN"] = "bench-token"
    env = dict(os.environ)
    system_blocks = args.system_tokens // BS
    request_blocks = (args.system_tokens + args.question_tokens + args.max_tokens) // BS + 2
    num_blocks = (args.systems + 1) // 2 * system_blocks + args.concurrency * request_blocks + 4
    stacks = [
        LocalStack(
            work / f"node-{i}",
            [
                "--model",
                model,
                "--num-blocks",
                str(num_blocks),
                "--swap-space",
                "0",
                "--log-level",
                "WARNING",
            ],
            ["--model", model, "--threads", "1", "--log-level", "WARNING"],
            num_replicas=1,
            env=env,
        )
        for i in range(2)
    ]
    prompts = workload(args)
    rows = {}
    try:
        for stack in stacks:
            stack.up()
        nodes = []
        for i, stack in enumerate(stacks):
            nodes += ["--node", f"node-{i}@{stack.cache_address}={','.join(stack.compute_addresses)}"]
        for k, policy in enumerate(POLICIES):
            argv = ["--host", "127.0.0.1", "--port", "0", "--model", model, *nodes, "--routing", policy]
            argv += ["--log-level", "WARNING"]
            gateway = wait_gateway(start(f"gateway-{policy}", "gateway", argv, "", work, env))
            try:
                results, wall = asyncio.run(run_policy(gateway.address, prompts, args, f"bench-{k}"))
            finally:
                gateway.stop()
            errors = [r.error for r in results if r.error]
            if errors:
                print(f"{policy}: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
                return 1
            ttfts = sorted(r.ttft_s for r in results)
            rows[policy] = {
                "hit": sum(r.cached for r in results) / sum(r.prompt for r in results),
                "p50": 1000 * statistics.median(ttfts),
                "p99": 1000 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
                "tok_s": sum(r.tokens for r in results) / wall,
            }
    finally:
        for stack in stacks:
            stack.down()
    print(
        f"two nodes of {num_blocks} blocks each (one holds ~half of {args.systems} system prompts of "
        f"{args.system_tokens} tokens); {len(prompts)} requests, {args.concurrency} in flight, "
        f"{args.max_tokens} new tokens each"
    )
    print(f"{'routing':>12} {'hit %':>6} {'TTFT p50 ms':>12} {'p99 ms':>8} {'tok/s':>7}")
    for policy, r in rows.items():
        print(f"{policy:>12} {100 * r['hit']:6.1f} {r['p50']:12.1f} {r['p99']:8.1f} {r['tok_s']:7.1f}")
    kv, rr = rows["kv-aware"], rows["round-robin"]
    print(
        f"headline: kv-aware routing hits {100 * kv['hit']:.0f}% of prompt tokens vs {100 * rr['hit']:.0f}% round-robin; "
        f"TTFT p50 {kv['p50']:.0f} ms vs {rr['p50']:.0f} ms = {rr['p50'] / kv['p50']:.1f}x lower (target >= 2x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
