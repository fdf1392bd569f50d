"""The tiered prefix cache through the real service: TTFT of a 2,000-token shared prefix served
from the device pool, from the host cache, from the disk, and by recompute (issue 22).

``bench/tiers.py`` measures the tiers in one process (load cost, hit rates); this runs the
local stack (cache service + one compute replica, real processes, bench/prefix_ttft.py's random
8-layer Llama). Each request is the 2,000-token prefix plus its own 32-token question, one at a
time, ``max_tokens`` 1:

- device: the prefix was just served, its blocks are in the pool;
- host: filler requests (unique cache salts) evicted it from the pool to the host cache
  (``--host-cache-gib``), Allocate promotes it back;
- disk: a second stack without a host cache, ``--disk-path`` only: evicted blocks are written
  to disk, Allocate reads and checks each record;
- recompute: the same request under a cache salt never seen (no block shared).

    python bench/tiers_e2e.py            # 3 rounds
    python bench/tiers_e2e.py --quick    # 1 round

Targets (issue 22): host <= 0.2x recompute, disk <= 0.3x recompute. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_ttft import make_model_dir, ttfts  # noqa: E402

PREFIX_TOKENS = 2000
QUESTION_TOKENS = 32
POOL_BLOCKS = 160  # 2,560 tokens: two filler requests of 127 blocks evict everything older
FILLERS = 2
STATS_DEADLINE_S = 120.0  # for the disk writer to land the prefix's records


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7 + 3) % 256 for i in range(n)]


async def round_trip(client, stack, rnd: int, lower: str) -> dict[str, float]:
    """One round: device, then ``lower`` ("host" or "disk") after fillers, then recompute (ms)."""
    prefix = tokens(0, PREFIX_TOKENS)
    ask = [tokens(1000 + 10 * rnd + q, QUESTION_TOKENS) for q in range(3)]
    await ttfts(client, [prefix + ask[0]], [""])  # the prefix is on the device now
    (device,) = await ttfts(client, [prefix + ask[1]], [""])
    fillers = [tokens(5000 + 10 * rnd + f, PREFIX_TOKENS + QUESTION_TOKENS) for f in range(FILLERS)]
    await ttfts(client, fillers, [f"filler-{rnd}-{f}" for f in range(FILLERS)])
    if lower == "disk":
        wait_for_disk(stack)
    (below,) = await ttfts(client, [prefix + ask[2]], [""])
    (recompute,) = await ttfts(client, [prefix + ask[2]], [f"never-seen-{lower}-{rnd}"])
    return {"device": 1000 * device, lower: 1000 * below, "recompute": 1000 * recompute}


def wait_for_disk(stack) -> None:
    """Until the disk tier's write queue is empty (its records are on disk, off the RPC path)."""
    from kvtier.cache_client import CacheClient

    client = CacheClient.connect(stack.cache_address, os.environ["KVTIER_TOKEN"], timeout_s=10.0)
    try:
        deadline = time.monotonic() + STATS_DEADLINE_S
        while time.monotonic() < deadline:
            disk = [t for t in client.get_stats().tiers if t.medium == "disk"]
            if disk and disk[0].write_queue_depth == 0 and disk[0].num_blocks:
                return
            time.sleep(0.1)  # polling the writer's progress with a deadline
        raise TimeoutError(f"disk write queue not empty within {STATS_DEADLINE_S:.0f} s")
    finally:
        client.close()


def run_stack(work: Path, model: str, lower: str, rounds: int) -> list[dict[str, float]]:
    from kvtier.cli.stack import LocalStack
    from kvtier.compute_client import ComputeClient

    # The disk stack has no host cache (on by default): evictions go straight to the disk.
    tier_flags = (
        ["--host-cache-gib", "1"]
        if lower == "host"
        else ["--host-cache-gib", "0", "--disk-path", str(work / "disk"), "--disk-gib", "1"]
    )
    # A 2,000-token prefill takes seconds on a busy CPU: a lease outlives it.
    cache_args = [
        "--model",
        model,
        "--num-blocks",
        str(POOL_BLOCKS),
        "--swap-space",
        "0",
        "--lease-ttl",
        "300",
        *tier_flags,
    ]
    stack = LocalStack(
        work / f"run-{lower}",
        [*cache_args, "--log-level", "WARNING"],
        ["--model", model, "--threads", str(min(4, os.cpu_count() or 1))],
        num_replicas=1,
        env=dict(os.environ),
    )

    async def rounds_of() -> list[dict[str, float]]:
        client = ComputeClient(stack.compute_addresses, os.environ["KVTIER_TOKEN"])
        try:
            return [await round_trip(client, stack, rnd, lower) for rnd in range(rounds)]
        finally:
            await client.close()

    with stack:
        return asyncio.run(rounds_of())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="measurements per tier")
    ap.add_argument("--model", help="local HF model dir (default: bench/prefix_ttft.py's random Llama)")
    ap.add_argument("--quick", action="store_true", help="one round")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-tiers-"))
    model = args.model or str(make_model_dir(work / "model"))
    os.environ["KVTIER_TOKEN"] = "bench-token"
    results = run_stack(work, model, "host", rounds) + run_stack(work, model, "disk", rounds)
    ms = {
        name: statistics.median([r[name] for r in results if name in r])
        for name in ("device", "host", "disk", "recompute")
    }
    print(
        f"TTFT of a {PREFIX_TOKENS}-token shared prefix + {QUESTION_TOKENS}-token question, median of {rounds}"
    )
    for name, value in ms.items():
        print(f"{name:>10} {value:9.1f} ms  {value / ms['recompute']:5.2f}x recompute")
    print(
        f"headline: TTFT of a {PREFIX_TOKENS}-token prefix from host {ms['host']:.1f} ms = "
        f"{ms['host'] / ms['recompute']:.2f}x and from disk {ms['disk']:.1f} ms = "
        f"{ms['disk'] / ms['recompute']:.2f}x recompute ({ms['recompute']:.1f} ms; targets <= 0.2x, <= 0.3x); "
        f"device {ms['device']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
