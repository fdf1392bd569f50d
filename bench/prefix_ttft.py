"""Prefix caching: time to first token with a shared ~1k-token system prompt, caching on vs off.

The full local stack runs (cache service + one compute replica, real processes). Each request
is the same 1,000-token system prompt followed by its own 32-token question. "On": requests
share the prefix cache (the first one warms it and is not counted). "Off" (the baseline, same
run): every request carries its own cache_salt, so no block is ever shared. Requests go one at
a time so TTFT is not queueing.

The model is a random Llama (byte vocabulary) big enough that prefill costs something on a CPU
(hidden 512, 8 layers), saved to a temporary directory; --model uses a real one instead.

    python bench/prefix_ttft.py            # 8 requests each way
    python bench/prefix_ttft.py --quick    # 4 each way

Target (issue 4): >= 5x lower TTFT with prefix caching on. The last line is the headline.
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

SYSTEM_TOKENS = 1000
QUESTION_TOKENS = 32


def make_model_dir(path: Path, seed: int = 0) -> Path:
    """A random byte-vocabulary Llama (hidden 512, 8 layers) saved like any HF checkpoint."""
    from models import random_llama_dir

    return random_llama_dir(
        path, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, max_positions=2048, seed=seed
    )


async def ttfts(client, prompts: list[list[int]], salts: list[str]) -> list[float]:
    out = []
    for prompt, salt in zip(prompts, salts, strict=True):
        request = client.request(prompt_token_ids=prompt, max_tokens=1, temperature=0, cache_salt=salt)
        t0 = time.perf_counter()
        async for _reply in client.stream(request):
            out.append(time.perf_counter() - t0)
            break
        await asyncio.sleep(0)  # let the stream's cancellation settle before the next request
    return out


async def measure(addresses: list[str], n: int) -> tuple[list[float], list[float]]:
    from kvtier.compute_client import ComputeClient

    client = ComputeClient(addresses, os.environ["KVTIER_TOKEN"])
    system = [(i * 7 + 3) % 256 for i in range(SYSTEM_TOKENS)]
    questions = [[(q * 31 + j * 5) % 256 for j in range(QUESTION_TOKENS)] for q in range(2 * n + 1)]
    await ttfts(client, [system + questions[-1]], [""])  # warm: model, allocator, and the cache
    on = await ttfts(client, [system + q for q in questions[:n]], [""] * n)
    off = await ttfts(client, [system + q for q in questions[n : 2 * n]], [f"unique-{i}" for i in range(n)])
    await client.close()
    return on, off


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8, help="requests each way")
    ap.add_argument("--model", help="local HF model dir (default: a random 8-layer Llama)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.requests = 4

    from kvtier.cli.stack import LocalStack

    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-ttft-"))
    model = args.model or str(make_model_dir(work / "model"))
    os.environ["KVTIER_TOKEN"] = "bench-token"
    env = dict(os.environ)
    stack = LocalStack(
        work / "run",
        ["--model", model, "--num-blocks", "2048", "--swap-space", "0", "--log-level", "WARNING"],
        ["--model", model, "--threads", str(min(4, os.cpu_count() or 1))],
        num_replicas=1,
        env=env,
    )
    with stack:
        on, off = asyncio.run(measure(stack.compute_addresses, args.requests))
    on_ms, off_ms = 1000 * statistics.median(on), 1000 * statistics.median(off)
    print(f"{'prefix caching':>15} {'TTFT p50 ms':>12} {'min':>8} {'max':>8}")
    for name, v in (("on", on), ("off (baseline)", off)):
        print(f"{name:>15} {1000 * statistics.median(v):12.1f} {1000 * min(v):8.1f} {1000 * max(v):8.1f}")
    print(
        f"headline: TTFT with a shared {SYSTEM_TOKENS}-token system prompt: {on_ms:.1f} ms with prefix caching vs "
        f"{off_ms:.1f} ms without = {off_ms / on_ms:.1f}x lower (target >= 5x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
