"""`kvtier demo`: its workload (a few long shared system prompts, many short questions), run
against a stack's replicas with the cache service's block usage watched, and the summary it
prints."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

DEMO_SYSTEM_PROMPTS = [
    "You are a careful assistant for a bakery. Answer questions about bread, pastry, opening hours and "
    "allergens in one or two short sentences. Never invent prices; say you do not know instead. ",
    "You are a support agent for a bicycle shop. Help customers with repairs, tyre sizes, brakes and "
    "gears. Be concise and friendly, and suggest a visit to the workshop when a fix needs tools. ",
    "You are a travel guide for a small mountain town. Recommend hikes, huts, bus times and weather "
    "precautions. Keep answers practical and mention when a trail is closed in winter. ",
    "You are a study helper for high-school chemistry. Explain reactions, moles and the periodic table "
    "step by step with one small worked example, and check the units of every number you give. ",
]
DEMO_QUESTIONS = [
    "What do you recommend today?",
    "Is it open on Sunday?",
    "How long does it take?",
    "What should I bring?",
    "Can you explain that again?",
    "What is the most common mistake?",
    "Is there a cheaper option?",
    "What happens if it rains?",
]


def demo_workload(num_requests: int, seed: int = 0) -> list[tuple[str, str]]:
    """(system prompt, question) pairs: a few long shared prefixes, many short questions."""
    rng = random.Random(seed)
    return [(rng.choice(DEMO_SYSTEM_PROMPTS), rng.choice(DEMO_QUESTIONS)) for _ in range(num_requests)]


async def run_demo(info: dict, args) -> dict:
    """The workload of `args` (requests, concurrency, max_tokens, seed) against the stack `info`
    names; returns its summary (throughput, TTFT, prefix hit rate, peak block usage)."""
    from tqdm import tqdm

    from kvtier.cache_client import CacheClient
    from kvtier.compute_client import ComputeClient

    client = ComputeClient(info["compute"])
    cache = CacheClient.connect(info["cache"], aio=True)
    limit = asyncio.Semaphore(args.concurrency)
    results = []
    peak_used = 0
    bar = tqdm(total=args.requests, desc="demo requests", unit="req")

    async def one(i: int, system: str, question: str):
        async with limit:
            req = client.request(
                f"{system}User: {question}\nAssistant:", max_tokens=args.max_tokens, temperature=0.8, seed=i
            )
            results.append(await client.complete(req))
            bar.update(1)

    async def watch_usage():
        nonlocal peak_used
        while True:
            stats = await cache.get_stats()
            peak_used = max(peak_used, stats.num_blocks_used)
            await asyncio.sleep(0.1)

    start = time.monotonic()
    watcher = asyncio.ensure_future(watch_usage())
    try:
        await asyncio.gather(
            *[one(i, s, q) for i, (s, q) in enumerate(demo_workload(args.requests, args.seed))]
        )
    finally:
        watcher.cancel()
        bar.close()
    elapsed = time.monotonic() - start
    stats = await cache.get_stats()
    await cache.close()
    await client.close()
    ttfts = sorted(r.time_to_first_token_s for r in results)
    prompt = sum(r.prompt_tokens for r in results)
    return {
        "requests": len(results),
        "seconds": elapsed,
        "output_tokens": sum(r.completion_tokens for r in results),
        "tokens_per_s": sum(r.completion_tokens for r in results) / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "prefix_hit_rate": sum(r.cached_prompt_tokens for r in results) / max(1, prompt),
        "peak_blocks_used": peak_used,
        "blocks_total": stats.num_blocks_total,
        "blocks_cached": stats.num_blocks_cached,
    }


def print_summary(summary: dict, replicas: int) -> None:
    """The summary of `run_demo` as a table, then in one line."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier demo: {replicas} compute replicas sharing one cache service")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests", f"{summary['requests']}")
    table.add_row("output tokens", f"{summary['output_tokens']}")
    table.add_row("throughput", f"{summary['tokens_per_s']:.1f} tokens/s")
    table.add_row("TTFT p50 / p99", f"{summary['ttft_p50_ms']:.1f} / {summary['ttft_p99_ms']:.1f} ms")
    table.add_row("prefix hit rate", f"{100 * summary['prefix_hit_rate']:.1f}% of prompt tokens")
    table.add_row("KV blocks used (peak)", f"{summary['peak_blocks_used']} of {summary['blocks_total']}")
    table.add_row("KV blocks cached (end)", f"{summary['blocks_cached']}")
    Console().print(table)
    print(
        f"demo: {summary['requests']} requests, {summary['tokens_per_s']:.1f} tokens/s, "
        f"prefix hit rate {100 * summary['prefix_hit_rate']:.1f}%"
    )


def blocks_per_gib(shape, block_size: int) -> dict[str, int]:
    """Pool blocks of `block_size` tokens that one GiB holds for each KV dtype of kvtier.kv_dtypes,
    scales included (`ModelShape.block_bytes`): {dtype name: blocks}."""
    from kvtier import kv_dtypes

    return {name: (1 << 30) // shape.block_bytes(block_size, name) for name in kv_dtypes.TABLE}


def print_kv_dtypes(model_dir: str | None, block_size: int) -> None:
    """`kvtier demo --kv-dtypes`: blocks and tokens per GiB of pool for each KV dtype (the values
    of `--kv-cache-dtype`) for the model `model_dir` (None: the built-in tiny model)."""
    from rich.console import Console
    from rich.table import Table

    from kvtier.model_spec import ModelShape

    shape = ModelShape.from_model_dir(model_dir) if model_dir else ModelShape.tiny()
    counts = blocks_per_gib(shape, block_size)
    table = Table(title=f"KV pool capacity per GiB ({model_dir or 'tiny model'}, block_size {block_size})")
    for column in ("--kv-cache-dtype", "blocks per GiB", "tokens per GiB"):
        table.add_column(column, justify="left" if column.startswith("--") else "right")
    for name, blocks in counts.items():
        table.add_row(name, f"{blocks:,}", f"{blocks * block_size:,}")
    Console().print(table)
    print("kv dtypes: " + ", ".join(f"{name} {blocks} blocks/GiB" for name, blocks in counts.items()))
