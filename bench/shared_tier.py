"""The shared tier on Mooncake Store (issue 34): two nodes on this machine, one store, same run.

Three measurements, each against its baseline:

1. **TTFT from the store**: a 2,000-token prefix + a 32-token question computed on node A (its
   blocks go to the store as they are published), then sent to node B, which never saw it: B
   fetches the prefix from the store. Against B recomputing it (the same request under a cache
   salt never seen). Median of --rounds, a new prefix each round. Target <= 0.3x.
2. **Hit rate across a restart**: bench/router.py's workload (chats over Zipf-popular system
   prompts, multi-turn; --chats of them, one at a time) through a kv-aware gateway over two nodes.
   Half way, node A's cache service is SIGKILLed and restarted (its pool and host cache gone; its
   replica re-attaches). With the shared tier against without it, both against the same stack with
   no restart. Target: with the shared tier, >= 0.9x the hit rate without a restart.
3. **Throughput**: the shared tier's stores and loads of pool-sized blocks (bench model's block,
   every check included) against a plain client loop of the same objects (``put`` / ``get`` on
   ``MooncakeDistributedStore``), in one process.
4. **Tenants**: the same throughput through a strict multi-tenant master (what ``kvtier up
   --api-keys`` runs), the blocks spread over 4 tenants (4 Mooncake clients on one transfer
   engine) against all of them as the default tenant (one client), alternating, same store.

    python bench/shared_tier.py                   # 3 rounds, 40 chats
    python bench/shared_tier.py --quick           # 1 round, 24 chats
    python bench/shared_tier.py --throughput-only # measurements 3 and 4

The model is bench/prefix_ttft.py's random 8-layer Llama. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_ttft import make_model_dir, ttfts  # noqa: E402

PREFIX_TOKENS = 2000
QUESTION_TOKENS = 32
TOKEN = "bench-token-shared-tier"
DEADLINE_S = 120.0


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7 + 3) % 256 for i in range(n)]


def node_args(model: str) -> tuple[list[str], list[str]]:
    # A 2,000-token prefill takes seconds on a busy CPU: a lease outlives it.
    cache = ["--model", model, "--lease-ttl", "300", "--swap-space", "0", "--log-level", "WARNING"]
    compute = ["--model", model, "--threads", str(min(2, os.cpu_count() or 1)), "--log-level", "WARNING"]
    return cache, compute


def shared_row(node):
    from kvtier.cache_client import CacheClient

    client = CacheClient.connect(node.cache_address, TOKEN, timeout_s=10.0)
    try:
        return next(t for t in client.get_stats().tiers if t.medium == "shared")
    finally:
        client.close()


def wait_stored(node, at_least: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while shared_row(node).num_stored_blocks < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the store did not take {at_least} blocks within {DEADLINE_S:.0f} s")
        time.sleep(0.05)  # polling the store writer's progress with a deadline


# ---------------------------------------------------------------- 1. TTFT


def ttft_rounds(work: Path, model: str, rounds: int) -> list[dict[str, float]]:
    from kvtier.cli.stack import MultiNodeStack
    from kvtier.compute_client import ComputeClient

    cache, compute = node_args(model)
    stack = MultiNodeStack(work / "ttft", 2, cache, compute, 1, dict(os.environ), shared_tier_gib=2.0)

    async def measure() -> list[dict[str, float]]:
        a, b = (ComputeClient(n.compute_addresses, TOKEN) for n in stack.nodes)
        try:
            out, stored = [], 0
            for rnd in range(rounds):
                prefix = tokens(rnd, PREFIX_TOKENS)
                ask = [tokens(1000 + 10 * rnd + q, QUESTION_TOKENS) for q in range(2)]
                await ttfts(a, [prefix + ask[0]], [""])  # computed on A, written through to the store
                stored += PREFIX_TOKENS // 16
                wait_stored(stack.nodes[0], stored)
                (store,) = await ttfts(b, [prefix + ask[1]], [""])
                (recompute,) = await ttfts(b, [prefix + ask[1]], [f"never-seen-{rnd}"])
                out.append({"store": 1000 * store, "recompute": 1000 * recompute})
            return out
        finally:
            await a.close()
            await b.close()

    with stack:
        return asyncio.run(measure())


# ---------------------------------------------------------------- 2. hit rate across a restart


def chats(num: int) -> list[list[list[int]]]:
    """bench/router.py's workload: 12 system prompts of 512 tokens, Zipf 0.5, 1-3 turns."""
    from router import workload

    args = argparse.Namespace(
        seed=0,
        systems=12,
        system_tokens=512,
        conversations=num,
        zipf=0.5,
        turns=3,
        question_tokens=16,
        max_tokens=8,
    )
    return workload(args)


def hit_rate(work: Path, model: str, name: str, shared: bool, restart: bool, workload) -> float:
    """Cached / prompt tokens of ``workload`` through a kv-aware gateway over two nodes."""
    from kvtier.cli.stack import MultiNodeStack, wait_serving
    from kvtier.compute_client import ComputeClient

    cache, compute = node_args(model)
    gateway = ["--model", model, "--routing", "kv-aware", "--log-level", "WARNING"]
    stack = MultiNodeStack(
        work / name,
        2,
        cache,
        compute,
        1,
        dict(os.environ),
        gateway,
        0,
        shared_tier_gib=2.0 if shared else 0.0,
    )

    async def run() -> float:
        import aiohttp
        from router_client import one

        cached = total = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            for c, turns in enumerate(workload):
                if restart and c == len(workload) // 2:
                    node = stack.nodes[0]
                    node.cache.stop(signal.SIGKILL)
                    node.cache.restart()
                    wait_serving(node.cache)
                    await wait_replica(ComputeClient(node.compute_addresses, TOKEN))
                for prompt in turns:
                    r = await one(http, stack.gateway.address, prompt, 8, name)
                    if r.error:
                        raise RuntimeError(f"{name}: a request failed: {r.error}")
                    cached, total = cached + r.cached, total + r.prompt
        return cached / total

    with stack:
        return asyncio.run(run())


async def wait_replica(client) -> None:
    """Until node A's replica serves again (it re-attaches to the restarted cache on its own)."""
    deadline = time.monotonic() + DEADLINE_S
    try:
        while True:
            try:
                await ttfts(client, [tokens(9999, 16)], ["wait-replica"])
                return
            except Exception:  # noqa: BLE001 - not re-attached yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await client.close()


# ---------------------------------------------------------------- 3. throughput


def throughput(work: Path, block_bytes: int, num_blocks: int) -> dict[str, float]:
    """MB/s of the shared tier's stores and loads and of a plain put / get loop, same objects."""
    import torch
    from mooncake.store import MooncakeDistributedStore

    from kvtier.block_hash import extra_key
    from kvtier.cachesvc.disk_records import RecordLayout
    from kvtier.cachesvc.shared_tier import SharedTier
    from kvtier.cachesvc.store_client import StoreAddress, StoreClient
    from kvtier.cachesvc.tiers import Blocks, Job
    from kvtier.cli.store_master import StoreMaster

    layout = RecordLayout("bench", 16, "float32", (block_bytes // 4,), block_bytes)
    rows = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8)
    keys = [extra_key("bench", f"k{i}") + bytes(64) for i in range(num_blocks)]
    mb = num_blocks * block_bytes / 1e6
    with StoreMaster(work / "store", store_gib=2 * mb * 3 / 1e3 + 0.25) as master:
        client = StoreClient(StoreAddress.parse(master.url, master.metadata_url), timeout_s=30.0)
        client.connect()
        while not client.available:
            time.sleep(0.05)  # the client connects off this thread
        tier = SharedTier(client, layout)
        t0 = time.perf_counter()
        tier.submit_store(Blocks(keys, rows, list(range(num_blocks))))
        client.wait_written(DEADLINE_S)
        put_s = time.perf_counter() - t0
        out = torch.empty_like(rows)
        t0 = time.perf_counter()
        tier.submit_load(Job(1, Blocks(keys, out, list(range(num_blocks)))))
        (done,) = tier.finished_jobs()
        get_s = time.perf_counter() - t0
        assert done.num_done == num_blocks and torch.equal(out, rows), (done, tier.counts())
        raw = MooncakeDistributedStore()
        raw.setup("127.0.0.1", master.metadata_url, 0, 64 << 20, "tcp", "", master.url.split("//")[1])
        payloads = [rows[i].numpy().tobytes() for i in range(num_blocks)]
        t0 = time.perf_counter()
        for i, p in enumerate(payloads):
            raw.put(f"plain/{i}", p)
        plain_put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(num_blocks):
            raw.get(f"plain/{i}")
        plain_get_s = time.perf_counter() - t0
        raw.close()
        tier.close()
    return {
        "put": mb / put_s,
        "get": mb / get_s,
        "plain_put": mb / plain_put_s,
        "plain_get": mb / plain_get_s,
    }


def tenant_throughput(work: Path, block_bytes: int, num_blocks: int, num_tenants: int = 4) -> dict:
    """MB/s of put and get as ``num_tenants`` tenants (round robin) and as the default tenant, under
    strict multi-tenant mode; median of 3 alternating rounds each. Loads: one job per tenant's run
    in both cases (the same job sizes)."""
    import json

    import torch

    from kvtier.block_hash import extra_key
    from kvtier.cachesvc.disk_records import RecordLayout
    from kvtier.cachesvc.shared_tier import SharedTier
    from kvtier.cachesvc.store_client import StoreAddress, StoreClient
    from kvtier.cachesvc.tiers import Blocks, Job
    from kvtier.cli.store_master import StoreMaster

    layout = RecordLayout("bench", 16, "float32", (block_bytes // 4,), block_bytes)
    rows = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8)
    names = [f"t{i}" for i in range(num_tenants)]
    keys_file = work / "tenants.json"
    keys_file.write_text(
        json.dumps({"tenants": {t: {"keys": [f"sk-bench-{t}-0123456789abcdef"]} for t in names}})
    )
    mb, out = num_blocks * block_bytes / 1e6, {}
    with StoreMaster(work / "tenant-store", store_gib=1.25, api_keys=str(keys_file)) as master:
        client = StoreClient(StoreAddress.parse(master.url, master.metadata_url), timeout_s=30.0)
        client.connect()
        tier = SharedTier(client, layout)
        clients = [tier.clients.of(t) for t in ("", *names)]
        while not all(c.available for c in clients):
            time.sleep(0.05)
        for r in range(6):
            mode = ("tenants", "default")[r % 2 if r < 2 else (r + 1) % 2]
            tenants = [names[i % num_tenants] if mode == "tenants" else "" for i in range(num_blocks)]
            keys = [extra_key("bench", f"{r}:{t}") + i.to_bytes(64, "big") for i, t in enumerate(tenants)]
            t0 = time.perf_counter()
            tier.submit_store(Blocks(keys, rows, list(range(num_blocks)), tenants))
            assert all(c.wait_written(DEADLINE_S) for c in clients)
            put_s = time.perf_counter() - t0
            dst, done = torch.empty_like(rows), 0
            t0 = time.perf_counter()
            for j in range(num_tenants):  # the blocks of one tenant (or one quarter) per job
                ids = list(range(j, num_blocks, num_tenants))
                tier.submit_load(Job(j, Blocks([keys[i] for i in ids], dst, ids), tenants[j]))
                done += tier.finished_jobs()[0].num_done
            get_s = time.perf_counter() - t0
            assert done == num_blocks and torch.equal(dst, rows), (mode, done, tier.counts())
            out.setdefault(mode, []).append((mb / put_s, mb / get_s))
        tier.close()
    return {m: tuple(statistics.median(x[k] for x in v) for k in (0, 1)) for m, v in out.items()}


def print_throughput(work: Path) -> tuple[dict, dict]:
    block_bytes = (
        8 * 2 * 16 * 4 * 64 * 4
    )  # the bench model's block: 8 layers, K and V, 16 tokens, 4 x 64 fp32
    mbs = throughput(work, block_bytes, 256)
    print(f"throughput of 256 blocks of {block_bytes >> 10} KiB through one store (MB/s):")
    print(
        f"  shared tier: put {mbs['put']:7.1f}  get {mbs['get']:7.1f}   (encode + checksum + checks included)"
    )
    print(f"  plain client loop: put {mbs['plain_put']:7.1f}  get {mbs['plain_get']:7.1f}", flush=True)
    tenants = tenant_throughput(work, block_bytes, 256)
    print("the same through a strict multi-tenant master, median of 3 alternating rounds (MB/s):")
    for mode, (put, get) in tenants.items():
        name = "as 4 tenants (4 clients)" if mode == "tenants" else "as the default tenant"
        print(f"  {name:<26} put {put:7.1f}  get {get:7.1f}", flush=True)
    return mbs, tenants


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="TTFT measurements")
    ap.add_argument("--chats", type=int, default=40, help="chats of the hit-rate workload")
    ap.add_argument("--model", help="local HF model dir (default: bench/prefix_ttft.py's random Llama)")
    ap.add_argument("--quick", action="store_true", help="1 round, 24 chats")
    ap.add_argument("--throughput-only", action="store_true", help="measurements 3 and 4 only")
    args = ap.parse_args()
    rounds, num_chats = (1, 24) if args.quick else (args.rounds, args.chats)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-shared-"))
    if args.throughput_only:
        _, tenants = print_throughput(work)
        (put, get), (put1, get1) = tenants["tenants"], tenants["default"]
        print(f"headline: as 4 tenants put {put / put1:.2f}x, get {get / get1:.2f}x the default tenant's")
        return 0
    model = args.model or str(make_model_dir(work / "model"))
    os.environ["KVTIER_TOKEN"] = TOKEN

    results = ttft_rounds(work, model, rounds)
    store, recompute = (statistics.median(r[k] for r in results) for k in ("store", "recompute"))
    print(
        f"TTFT of a {PREFIX_TOKENS}-token prefix + {QUESTION_TOKENS}-token question on node B, median of {rounds}:"
    )
    print(
        f"  from the store {store:8.1f} ms  ({store / recompute:.2f}x)   recompute {recompute:8.1f} ms",
        flush=True,
    )

    workload = chats(num_chats)
    rates = {
        "no restart": hit_rate(work, model, "steady", False, False, workload),
        "restart, no shared tier": hit_rate(work, model, "restart", False, True, workload),
        "restart, shared tier": hit_rate(work, model, "restart-shared", True, True, workload),
    }
    print(
        f"hit rate (cached / prompt tokens) of {num_chats} chats, node A's cache service restarted half way:"
    )
    for name, rate in rates.items():
        print(f"  {name:<24} {rate:6.3f}  ({rate / rates['no restart']:.2f}x no restart)", flush=True)

    mbs, tenants = print_throughput(work)
    restart_ratio = rates["restart, shared tier"] / rates["no restart"]
    print(
        f"headline: a {PREFIX_TOKENS}-token prefix from the store on another node {store:.0f} ms = "
        f"{store / recompute:.2f}x recompute (target <= 0.3x); hit rate across a restart {restart_ratio:.2f}x "
        f"of none with the shared tier, {rates['restart, no shared tier'] / rates['no restart']:.2f}x without "
        f"(target >= 0.9x); get {mbs['get']:.0f} MB/s vs a plain loop's {mbs['plain_get']:.0f}; as 4 tenants "
        f"get {tenants['tenants'][1] / tenants['default'][1]:.2f}x the default tenant's"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
