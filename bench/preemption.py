"""Preemption policies under memory pressure: `cost` against `newest` on the same workload.

One real stack per policy (a cache service with tenant quotas, two compute replicas taking
client API keys, `--preemption-policy` the only difference), the same requests at the same
times: tenant "bulk" (quota: a third of the pool, over its fair share when it floods) sends long
requests; tenant "acme" (no quota) sends a mix of short and long ones, arriving over time. The
pool holds a fraction of what the requests need at once, so the replicas preempt.

Per policy: goodput (completion tokens/s of the requests that finished, over the run), p99 time
to first token (finished requests, as the client saw it), preemptions per request (the replicas'
log lines), and requests failed by tenant (the client fails over and resumes as it does by
default: a request fails when every attempt did, or when it is not done in --timeout-s).

    python bench/preemption.py             # ~1-2 min on 2 CPU cores
    python bench/preemption.py --quick

Target (issue 23): cost >= 1.2x the goodput and <= 0.7x the p99 TTFT of newest, and no acme
request failed. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.cli.stack import LocalStack  # noqa: E402
from kvtier.compute_client import ComputeClient  # noqa: E402

KEYS = {"bulk": "sk-bulk-" + secrets.token_hex(12), "acme": "sk-acme-" + secrets.token_hex(12)}


@dataclass
class Job:
    tenant: str
    at_s: float  # when it is sent, from the start of the run
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    tenant: str
    ok: bool
    tokens: int = 0
    ttft_s: float = 0.0
    error: str = ""


def workload(args: argparse.Namespace) -> list[Job]:
    """bulk's long requests all at once at the start, then acme's mix at a steady rate."""
    rng = random.Random(args.seed)
    jobs = [
        Job("bulk", 0.0, [1 + (k * 37 + j * 11) % 250 for j in range(args.long_prompt)], args.long_tokens)
        for k in range(args.bulk)
    ]
    for k in range(args.acme):
        long = rng.random() < 0.3
        n = rng.randrange(args.long_prompt // 2, args.long_prompt) if long else rng.randrange(16, 64)
        jobs.append(
            Job("acme", 1.0 + k / args.acme_rate, [1 + (k * 53 + j * 7) % 250 for j in range(n)],
                args.long_tokens if long else rng.randrange(16, 48))
        )  # fmt: skip
    return jobs


async def one(addresses: list[str], job: Job, t0: float, timeout_s: float) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + job.at_s - time.monotonic()))
    client = ComputeClient(addresses, KEYS[job.tenant])
    request = ComputeClient.request(
        prompt_token_ids=job.prompt, max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True
    )
    sent = time.monotonic()
    out = Outcome(job.tenant, False)
    try:
        async with asyncio.timeout(timeout_s):
            async for reply in client.stream(request):
                if reply.token_ids and not out.ttft_s:
                    out.ttft_s = time.monotonic() - sent
                out.tokens += len(reply.token_ids)
        out.ok = True
    except Exception as e:  # a failed request is a data point, not a crash
        details = e.details() if hasattr(e, "details") else str(e)
        out.error = f"{type(e).__name__}: {details}"[:160]
    finally:
        await client.close()
    return out


def run_policy(args: argparse.Namespace, policy: str, jobs: list[Job]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"kvtier-bench-preempt-{policy}-"))
    keys = run_dir / "api-keys.json"
    tenants = {
        "bulk": {"keys": [KEYS["bulk"]], "max_blocks": args.num_blocks // 3},
        "acme": {"keys": [KEYS["acme"]]},
    }
    keys.write_text(json.dumps({"tenants": tenants}))
    cache_args = ["--num-blocks", str(args.num_blocks), "--swap-space", "0.05", "--tenant-quotas", str(keys)]
    cache_args += ["--host-cache-gib", "0"]  # else swap takes the host cache's slots, not 0.05 GiB
    compute_args = ["--api-keys", str(keys), "--preemption-policy", policy]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env.update(KVTIER_RUN_DIR=str(run_dir), KVTIER_TOKEN="bench-" + secrets.token_hex(8))
    with LocalStack(run_dir, cache_args, compute_args, 2, env) as stack:

        async def all_jobs():
            t0 = time.monotonic()
            outcomes = await asyncio.gather(
                *(one(stack.compute_addresses, j, t0, args.timeout_s) for j in jobs)
            )
            return outcomes, time.monotonic() - t0

        outcomes, elapsed = asyncio.run(all_jobs())
        logs = "".join(r.log() for r in stack.replicas)
    found = re.findall(r"preempted request \S+ \((\w+)\): (will recompute|swapped out)", logs)
    preemptions = len(found)
    by_reason = {
        f"{reason}/{what.split()[-1]}": found.count((reason, what)) for reason, what in sorted(set(found))
    }
    done = [o for o in outcomes if o.ok]
    ttfts = sorted(o.ttft_s for o in done)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("inf")
    return {
        "policy": policy,
        "goodput_tokens_per_s": sum(o.tokens for o in done) / elapsed,
        "p99_ttft_s": p99,
        "preemptions_per_request": preemptions / len(jobs),
        "preemptions_by_reason": by_reason,
        "failed": {t: sum(1 for o in outcomes if o.tenant == t and not o.ok) for t in KEYS},
        "errors": sorted({o.error for o in outcomes if not o.ok})[:3],
        "elapsed_s": elapsed,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-blocks", type=int, default=96, help="pool blocks (16 tokens each)")
    ap.add_argument("--bulk", type=int, default=10, help="bulk's long requests, sent at once")
    ap.add_argument("--acme", type=int, default=16, help="acme's requests, a steady stream")
    ap.add_argument("--acme-rate", type=float, default=2.0, help="acme's requests per second")
    ap.add_argument("--long-prompt", type=int, default=96, help="tokens of a long prompt")
    ap.add_argument("--long-tokens", type=int, default=96, help="tokens a long request generates")
    ap.add_argument("--timeout-s", type=float, default=180.0, help="a request not done by then failed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="+", default=["newest", "cost"], choices=["newest", "cost"])
    ap.add_argument("--quick", action="store_true", help="half the requests, shorter ones")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.bulk, args.acme, args.long_tokens = 6, 8, 48
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    jobs = workload(args)
    results = {}
    for policy in args.policies:
        r = results[policy] = run_policy(args, policy, jobs)
        print(
            f"{policy:>6}: goodput {r['goodput_tokens_per_s']:.1f} tok/s, p99 TTFT {r['p99_ttft_s']:.2f} s, "
            f"{r['preemptions_per_request']:.2f} preemptions/request {r['preemptions_by_reason']}, failed {r['failed']} in {r['elapsed_s']:.1f} s"
            + (f"; errors: {r['errors']}" if r["errors"] else ""),
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if len(results) < 2:
        return
    new, old = results["cost"], results["newest"]
    goodput = new["goodput_tokens_per_s"] / max(old["goodput_tokens_per_s"], 1e-9)
    ttft = new["p99_ttft_s"] / old["p99_ttft_s"] if old["p99_ttft_s"] else float("inf")
    print(
        f"preemption cost vs newest: {goodput:.2f}x goodput (target >= 1.2), {ttft:.2f}x p99 TTFT (target <= 0.7), "
        f"{new['preemptions_per_request']:.2f} vs {old['preemptions_per_request']:.2f} preemptions/request, "
        f"acme failed {new['failed']['acme']} (target 0) vs {old['failed']['acme']}"
    )


if __name__ == "__main__":
    main()
