"""Warm restart of the tiered prefix cache (issue 22): the hit rate of a repeated workload after
the cache service is SIGKILLed and restarted with the same ``--disk-path``, against the rate
before the restart.

A real ``python -m kvtier.cachesvc`` (cpu-shm pool of ``--pool-blocks`` blocks, no host cache, the disk
tier on ``--disk-path``) and a leased client that allocates, commits and frees each prompt, as a
replica would (no model: the hit rate is the cache's). The workload is ``--prompts`` distinct
prompts of ``--blocks`` full blocks (+ 1 token), a working set 4x the pool by default, each
asked in a seeded Zipf order (``--requests`` of them):

1. pass 1 publishes them (evictions go to disk, off the RPC path);
2. pass 2 repeats the same requests: the rate before the restart (device and disk hits);
3. SIGKILL at once (what the write queue still held is lost), restart with the same directory,
   pass 3 repeats them again: the rate after the restart (the disk index is rebuilt by the scan).

    python bench/tiers_restart.py            # 400 requests
    python bench/tiers_restart.py --quick    # 150 requests

Target: after / before >= 0.9. The last line is the headline.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import time
from pathlib import Path

TOKEN = "bench-token"
BS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-blocks", type=int, default=64, help="the device pool, in blocks")
    ap.add_argument("--blocks", type=int, default=4, help="full blocks per prompt")
    ap.add_argument("--prompts", type=int, default=64, help="distinct prompts (64 x 4 blocks = 4x the pool)")
    ap.add_argument("--requests", type=int, default=400, help="requests per pass")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of prompt popularity")
    ap.add_argument("--quick", action="store_true", help="150 requests per pass")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = 150
    return args


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """``--requests`` prompts drawn from ``--prompts`` distinct ones by Zipf popularity (seeded)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.blocks * BS + 1)] for _ in range(args.prompts)]
    weights = [1 / (k + 1) ** args.zipf for k in range(args.prompts)]
    return rng.choices(prompts, weights, k=args.requests)


def one_pass(address: str, requests: list[list[int]]) -> float:
    """Allocate, commit and free each request in turn; the hit rate: cached / full-block tokens."""
    from kvtier.cache_client import CacheClient

    client = CacheClient.connect(address, TOKEN, timeout_s=60.0)
    try:
        client.attach("tiers-restart-bench")
        cached = full = 0
        for tokens in requests:
            (seq,) = client.allocate([tokens])
            n = len(tokens) // BS * BS
            client.commit([(seq.sequence_id, [], n)])
            client.free([seq.sequence_id])
            cached += seq.num_cached_tokens
            full += n
        return cached / full
    finally:
        client.close()


def disk_tier(address: str):
    """The disk tier's TierStats row."""
    from kvtier.cache_client import CacheClient

    client = CacheClient.connect(address, TOKEN, timeout_s=10.0)
    try:
        return next(t for t in client.get_stats().tiers if t.medium == "disk")
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    from kvtier.cli.stack import LocalStack, wait_serving
    from kvtier.model_spec import ModelShape

    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-restart-"))
    requests = workload(args, ModelShape.tiny().vocab_size)
    cache_args = ["--backend", "cpu-shm", "--block-size", str(BS), "--num-blocks", str(args.pool_blocks)]
    # No host cache (on by default): evictions go straight to the disk, the tier under test.
    cache_args += ["--swap-space", "0", "--host-cache-gib", "0", "--lease-ttl", "60"]
    cache_args += ["--disk-path", str(work / "disk")]
    env = {**os.environ, "KVTIER_TOKEN": TOKEN}
    stack = LocalStack(
        work / "run", cache_args=[*cache_args, "--log-level", "WARNING"], num_replicas=0, env=env
    )
    svc = stack.start_cache()
    try:
        t0 = time.monotonic()
        one_pass(svc.address, requests)
        before = one_pass(svc.address, requests)
        queued = disk_tier(svc.address).write_queue_depth
        svc.stop(signal.SIGKILL)
        svc.restart()
        wait_serving(svc)
        records = disk_tier(svc.address).num_blocks
        after = one_pass(svc.address, requests)
        elapsed = time.monotonic() - t0
    finally:
        stack.down()
    print(
        f"{args.requests} requests per pass over {args.prompts} prompts of {args.blocks} blocks "
        f"(Zipf {args.zipf}), a {args.pool_blocks}-block pool, disk tier only; {elapsed:.1f} s"
    )
    print(f"SIGKILL with {queued} blocks in the write queue; {records} records indexed after the restart")
    if not records:
        raise SystemExit("no record was indexed after the restart: the disk tier was never written")
    print(f"hit rate before the restart {before:.3f}, after {after:.3f}")
    print(
        f"headline: after SIGKILL + restart with the same --disk-path, hit rate {after / before:.2f} of before (target >= 0.9)"
    )


if __name__ == "__main__":
    main()
