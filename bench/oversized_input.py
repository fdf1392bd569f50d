"""Oversized input at the gateway (issue 26 item 5): what a 16 MiB prompt costs everyone else.

A stack (cache service, one replica, the gateway; the built-in tiny model). The baseline, in the
same run: a small streamed-to-the-end completion's latency alone. Then the same completions while
threads keep posting 16 MiB prompts (each refused with 413), and /health meanwhile.

Before the gateway bounded its input, such a prompt was tokenized on the event loop for 26 s,
during which /health and every other request waited (their latency 9.6x to 31x).

    .venv/bin/python bench/oversized_input.py [--quick]

Headline (last line): the small completion's median latency while refusing / alone (target
<= 1.5x), and the refusal's median time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import statistics
import tempfile
import time
from pathlib import Path

import httpx

KEY = "sk-bench-oversized"
SMALL = {"model": "kvtier-tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}


def timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--mib", type=int, default=16, help="size of each oversized prompt, MiB")
    ap.add_argument("--senders", type=int, default=2, help="processes posting oversized prompts")
    args = ap.parse_args()
    samples = 5 if args.quick else 20

    from kvtier.cli.stack import LocalStack

    run = Path(tempfile.mkdtemp(prefix="kvtier-bench-oversized-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env.update(KVTIER_RUN_DIR=str(run), KVTIER_TOKEN="bench-token", PYTHONUNBUFFERED="1")
    with LocalStack(run, ["--num-blocks", "256"], num_replicas=1, env=env,
                    gateway_args=["--api-key", KEY, "--log-level", "WARNING"], gateway_port=0) as stack:  # fmt: skip
        url, headers = stack.gateway.address, {"authorization": f"Bearer {KEY}"}

        def small() -> None:
            reply = httpx.post(f"{url}/v1/completions", json=SMALL, headers=headers, timeout=60)
            assert reply.status_code == 200, reply.text

        for _ in range(3):
            small()  # warm
        alone = [timed(small) for _ in range(samples)]
        # NOTE: the senders are processes of their own: threads here would take this process's
        # GIL from the small requests being timed, and the figure would measure this client.
        ctx = multiprocessing.get_context("spawn")
        stop, refusals = ctx.Event(), ctx.Queue()
        senders = [ctx.Process(target=refuse_until, args=(url, headers, args.mib, stop, refusals))
                   for _ in range(args.senders)]  # fmt: skip
        for sender in senders:
            sender.start()
        first = [refusals.get(timeout=120)]  # the senders are refusing from here on
        mixed = [timed(small) for _ in range(samples)]
        health = [timed(lambda: httpx.get(f"{url}/health", timeout=30)) for _ in range(samples)]
        stop.set()
        times = first
        while any(sender.is_alive() for sender in senders) or not refusals.empty():
            with contextlib.suppress(queue.Empty):  # drained before join: a sender flushes its queue
                times.append(refusals.get(timeout=0.5))
    a, m = statistics.median(alone), statistics.median(mixed)
    print(f"{args.mib} MiB prompts refused: {len(times)}, max {max(times) * 1000:.0f} ms")
    print(f"/health while refusing: max {max(health) * 1000:.0f} ms")
    print(f"small completion: median {a * 1000:.1f} ms alone, {m * 1000:.1f} ms while refusing")
    print(
        f"headline: small completion {m / a:.2f}x its latency alone while {args.mib} MiB prompts are "
        f"refused (target <= 1.5x); refusal median {statistics.median(times) * 1000:.0f} ms"
    )
    return 0


def refuse_until(url: str, headers: dict, mib: int, stop, refusals) -> None:
    """Post `mib` MiB prompts back to back until `stop` is set; each one's time to its 413 to `refusals`."""
    big = json.dumps({"model": "kvtier-tiny", "prompt": "a" * (mib << 20)}).encode()
    headers = headers | {"content-type": "application/json"}
    while not stop.is_set():
        start = time.monotonic()
        reply = httpx.post(f"{url}/v1/completions", content=big, headers=headers, timeout=60)
        assert reply.status_code == 413, (reply.status_code, reply.text[:200])
        refusals.put(time.monotonic() - start)


if __name__ == "__main__":
    raise SystemExit(main())
