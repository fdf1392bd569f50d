"""Preemption policies under memory pressure: `cost` against the newest-first rules on the same workload.

One real stack per policy (a cache service and compute replicas, `--preemption-policy` the only
difference), the same requests at the same times. Two workloads:

- `--workload tenants` (the default): tenant "bulk" (quota: a third of the pool, over its fair
  share when it floods) sends long requests; tenant "acme" (no quota) sends a mix of short and
  long ones, arriving over time; two replicas of the tiny model. NOTE: most of cost's lead here
  is the quota, not the cost model: `newest` preempts whichever sequence is newest, of any
  tenant, and swaps it (a swap keeps the blocks on the tenant's quota), so bulk's quota refuses
  room again at once and the replicas spin (a livelock), while cost frees bulk's own sequences.
- `--workload single`: one tenant, no quota, pure memory pressure. Long prompts arriving over
  time on a pool that holds a few of them, on one replica of a random Llama big enough that
  prefill dominates a step (`bench/models.py`, made in the run dir): recomputing a preempted
  sequence costs its whole prompt's prefill, swapping it costs its blocks over host memory. It
  compares cost, newest (swap) and newest-recompute (vLLM's rule) side by side.

Per policy: goodput (completion tokens/s of the requests that finished, over the run), p99 time
to first token (finished requests, as the client saw it), preemptions per request (the replicas'
log lines, by reason and mode), and requests failed by tenant (the client fails over and resumes
as it does by default: a request fails when every attempt did, or when it is not done in
--timeout-s).

    python bench/preemption.py                    # ~1-2 min on 2 CPU cores
    python bench/preemption.py --workload single  # ~3 min: three policies, the model made once
    python bench/preemption.py --quick

Target (issue 23, tenants): cost >= 1.2x the goodput and <= 0.7x the p99 TTFT of newest, and no
acme request failed. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from models import random_llama_dir

from kvtier.cli.stack import LocalStack
from kvtier.compute_client import ComputeClient
from kvtier.computesvc.preemption import POLICIES

KEYS = {
    "bulk": "sk-bulk-" + secrets.token_hex(12),
    "acme": "sk-acme-" + secrets.token_hex(12),
    "solo": "sk-solo-" + secrets.token_hex(12),
}
# The single workload's model: prefill of a long prompt costs far more than moving its KV
# (8 layers of hidden 768, 2 KV heads of 64: 128 KiB of KV per 16-token block in float32, ~40M
# parameters: a 512-token prefill is ~40 GFLOP, its swap 4 MiB each way).
BIG_MODEL = dict(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=2, max_positions=2048)


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


def single_workload(args: argparse.Namespace) -> list[Job]:
    """One tenant at a steady rate: a share of long prompts (up to --long-prompt tokens), the rest
    short (16-64), all generating --long-tokens; distinct prompts, so no prefix hit hides a
    recompute."""
    rng = random.Random(args.seed)
    jobs = []
    for k in range(args.requests):
        long = rng.random() < args.long_share
        n = rng.randrange(args.long_prompt // 2, args.long_prompt + 1) if long else rng.randrange(16, 64)
        tokens = [1 + (k * 53 + j * 7 + j * j) % 250 for j in range(n)]
        jobs.append(Job("solo", k / args.rate, tokens, args.long_tokens))
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


def stack_args(args: argparse.Namespace, policy: str, run_dir: Path) -> tuple[list[str], list[str]]:
    """The cache service's and the replicas' flags for `policy` on `args.workload`."""
    keys = run_dir / "api-keys.json"
    if args.workload == "tenants":
        tenants = {
            "bulk": {"keys": [KEYS["bulk"]], "max_blocks": args.num_blocks // 3},
            "acme": {"keys": [KEYS["acme"]]},
        }
    else:
        tenants = {"solo": {"keys": [KEYS["solo"]]}}
    keys.write_text(json.dumps({"tenants": tenants}))
    cache_args = ["--num-blocks", str(args.num_blocks), "--swap-space", str(args.swap_space)]
    cache_args += ["--tenant-quotas", str(keys)]
    cache_args += ["--host-cache-gib", "0"]  # else swap takes the host cache's slots, not --swap-space
    compute_args = ["--api-keys", str(keys), "--preemption-policy", policy]
    if args.model:
        cache_args += ["--model", str(args.model)]
        compute_args += ["--model", str(args.model)]
    return cache_args, compute_args


def run_policy(args: argparse.Namespace, policy: str, jobs: list[Job]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"kvtier-bench-preempt-{policy}-"))
    cache_args, compute_args = stack_args(args, policy, run_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env.update(KVTIER_RUN_DIR=str(run_dir), KVTIER_TOKEN="bench-" + secrets.token_hex(8))
    with LocalStack(run_dir, cache_args, compute_args, args.replicas, env) as stack:

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
    tenants = sorted({j.tenant for j in jobs})
    return {
        "policy": policy,
        "goodput_tokens_per_s": sum(o.tokens for o in done) / elapsed,
        "p99_ttft_s": p99,
        "preemptions_per_request": preemptions / len(jobs),
        "preemptions_by_reason": by_reason,
        "failed": {t: sum(1 for o in outcomes if o.tenant == t and not o.ok) for t in tenants},
        "errors": sorted({o.error for o in outcomes if not o.ok})[:3],
        "elapsed_s": elapsed,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["tenants", "single"], default="tenants", help="see above")
    ap.add_argument("--num-blocks", type=int, help="pool blocks (16 tokens each); default 96")
    ap.add_argument("--bulk", type=int, default=10, help="tenants: bulk's long requests, sent at once")
    ap.add_argument("--acme", type=int, default=16, help="tenants: acme's requests, a steady stream")
    ap.add_argument("--acme-rate", type=float, default=2.0, help="tenants: acme's requests per second")
    ap.add_argument("--requests", type=int, default=16, help="single: requests, a steady stream")
    ap.add_argument("--rate", type=float, default=4.0, help="single: requests per second")
    ap.add_argument("--long-share", type=float, default=0.5, help="single: share of long prompts")
    ap.add_argument("--long-prompt", type=int, help="tokens of a long prompt; default 96 (single: 512)")
    ap.add_argument("--long-tokens", type=int, help="tokens a long request generates; default 96")
    ap.add_argument("--swap-space", type=float, default=0.05, help="GiB of host memory for swapped KV")
    ap.add_argument(
        "--model", type=Path, help="model directory; default tiny (single: a random 8-layer Llama)"
    )
    ap.add_argument("--timeout-s", type=float, default=180.0, help="a request not done by then failed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy, taking turns; medians reported")
    ap.add_argument(
        "--policies", nargs="+", choices=list(POLICIES), help="default: all (tenants: newest, cost)"
    )
    ap.add_argument("--quick", action="store_true", help="half the requests, shorter ones")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    single = args.workload == "single"
    defaults = dict(num_blocks=96, long_prompt=512 if single else 96, long_tokens=96)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.policies = args.policies or (list(POLICIES) if single else ["newest", "cost"])
    args.replicas = 1 if single else 2
    if args.quick:
        args.bulk, args.acme, args.requests = 6, 8, 8
        args.long_tokens = 48 if not single else args.long_tokens
    return args


def median_run(runs: list[dict]) -> dict:
    """The first run, with the median of every run's goodput and p99 TTFT."""
    return {
        **runs[0],
        "goodput_tokens_per_s": statistics.median(r["goodput_tokens_per_s"] for r in runs),
        "p99_ttft_s": statistics.median(r["p99_ttft_s"] for r in runs),
        "runs": runs,
    }


def ratio(new: float, old: float) -> float:
    return new / old if old else float("inf")


def headline(args: argparse.Namespace, results: dict) -> str:
    cost = results["cost"]
    if args.workload == "tenants":
        old = results["newest"]
        return (
            f"preemption cost vs newest: {ratio(cost['goodput_tokens_per_s'], old['goodput_tokens_per_s']):.2f}x "
            f"goodput (target >= 1.2), {ratio(cost['p99_ttft_s'], old['p99_ttft_s']):.2f}x p99 TTFT (target <= 0.7), "
            f"{cost['preemptions_per_request']:.2f} vs {old['preemptions_per_request']:.2f} preemptions/request, "
            f"acme failed {cost['failed']['acme']} (target 0) vs {old['failed']['acme']}"
        )
    parts = [
        f"vs {name}: {ratio(cost['goodput_tokens_per_s'], r['goodput_tokens_per_s']):.2f}x goodput, "
        f"{ratio(cost['p99_ttft_s'], r['p99_ttft_s']):.2f}x p99 TTFT"
        for name, r in results.items()
        if name != "cost"
    ]
    return "preemption, one tenant under memory pressure, cost " + "; ".join(parts)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.workload == "single" and args.model is None:
        args.model = random_llama_dir(
            Path(tempfile.mkdtemp(prefix="kvtier-bench-preempt-model-")), **BIG_MODEL
        )
    jobs = workload(args) if args.workload == "tenants" else single_workload(args)
    runs: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    for _ in range(args.repeats):  # the policies take turns: load on a shared machine hits each alike
        for policy in args.policies:
            r = run_policy(args, policy, jobs)
            runs[policy].append(r)
            print(
                f"{policy:>16}: goodput {r['goodput_tokens_per_s']:.1f} tok/s, p99 TTFT {r['p99_ttft_s']:.2f} s, "
                f"{r['preemptions_per_request']:.2f} preemptions/request {r['preemptions_by_reason']}, "
                f"failed {r['failed']} in {r['elapsed_s']:.1f} s"
                + (f"; errors: {r['errors']}" if r["errors"] else ""),
                flush=True,
            )
    results = {policy: median_run(rs) for policy, rs in runs.items()}
    if args.repeats > 1:
        for policy, r in results.items():
            print(
                f"{policy:>16} (median of {args.repeats}): goodput {r['goodput_tokens_per_s']:.1f} tok/s, "
                f"p99 TTFT {r['p99_ttft_s']:.2f} s"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if "cost" in results and len(results) > 1 and (args.workload == "single" or "newest" in results):
        print(headline(args, results))


if __name__ == "__main__":
    main()
